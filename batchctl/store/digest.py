"""A dataset's content digest: one SHA-256 over its arrays' documents, every shard file's bytes
and its batchctl attributes (docs/format.md, "The digest"). Two builds of the same files with
the same options give the same digest whatever their workers, engine or interruptions; a
build publishes it (`digest` in the attributes, the report and `info`), `verify` recomputes it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from batchctl.store import storage
from batchctl.store.metadata import DatasetAttrs
from batchctl.store.zarrmeta import ZARR_JSON, ArrayMeta, DatasetFiles

DIGEST_VERSION = 1
HASH_THREADS = 8  # hashlib releases the GIL on big buffers; the shards are read and hashed side by side


def content_digest(files: DatasetFiles, arrays: Mapping[str, ArrayMeta], attrs: DatasetAttrs) -> str:
    """The digest of the dataset in `files` whose final attributes are `attrs` (their own
    `digest` left out). A shard file that is missing counts as such."""
    keys = []
    for name in sorted(arrays):
        arr = arrays[name]
        shards = -(-attrs.num_samples // arr.grid[0]) if arr.grid[0] else 0
        keys += [f"{name}/{ZARR_JSON}", *(arr.shard_key(shard) for shard in range(shards))]
    with ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="batchctl-digest") as pool:
        hashes = list(pool.map(lambda key: _file_sha256(files, key), keys))
    whole = hashlib.sha256(f"batchctl dataset digest {DIGEST_VERSION}\n".encode())
    for key, found in zip(keys, hashes, strict=True):
        whole.update(f"{key} {found}\n".encode())
    own = json.dumps(dataclasses.asdict(dataclasses.replace(attrs, digest="")), sort_keys=True, separators=(",", ":"))
    whole.update(f"attributes {hashlib.sha256(own.encode()).hexdigest()}\n".encode())
    return whole.hexdigest()


def _file_sha256(files: DatasetFiles, key: str) -> str:
    """Read in pieces (a shard may be 128 MiB or more; memory stays a few hundred KiB a thread)."""
    try:
        if files.remote:
            fs, root = storage.locate(files.location, files.storage_options)
            with fs.open(f"{root}/{key}", "rb") as remote:
                return hashlib.file_digest(remote, "sha256").hexdigest()
        with open(Path(files.location) / key, "rb") as local:
            return hashlib.file_digest(local, "sha256").hexdigest()
    except FileNotFoundError:
        return "missing"
