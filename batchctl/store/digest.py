"""A dataset's content digest: one SHA-256 over its arrays' documents, every shard file's bytes
and its batchctl attributes (docs/format.md, "The digest"). Two builds of the same files with
the same options give the same digest whatever their workers, engine or interruptions; a
build publishes it (`digest` in the attributes, the report and `info`), `verify` recomputes it.

A build does not read its shards back for it: the collator hashes each shard file as it writes
it (`journal.ShardDone.sha256`), and an incremental build takes the hashes of the shards it keeps
from the last build's info; only a shard no one hashed whole (resumed half-written, or written
by Dask tasks) is read here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from batchctl.errors import FormatError
from batchctl.store import storage
from batchctl.store.codec import NO_CHUNK, parse_shard_index
from batchctl.store.metadata import DatasetAttrs
from batchctl.store.untrusted import NotRegularFile, open_regular
from batchctl.store.zarrmeta import ZARR_JSON, ArrayMeta, DatasetFiles

DIGEST_VERSION = 1
HASH_THREADS = 8  # hashlib releases the GIL on big buffers; the shards are read and hashed side by side


def shard_keys(arrays: Mapping[str, ArrayMeta], num_samples: int) -> dict[str, list[str]]:
    """Every shard file a dataset of `num_samples` rows holds, by array, in shard order."""
    found = {}
    for name, arr in arrays.items():
        shards = -(-num_samples // arr.grid[0]) if arr.grid[0] else 0
        found[name] = [arr.shard_key(shard) for shard in range(shards)]
    return found


def hashes_by_key(arrays: Mapping[str, ArrayMeta], by_shard: Mapping[int, Mapping[str, str]]) -> dict[str, str]:
    """Shard files' hashes by file key, from the journal's shape (shard -> {array: hash})."""
    return {
        arrays[name].shard_key(shard): found
        for shard, hashes in by_shard.items()
        for name, found in hashes.items()
        if name in arrays
    }


def hashes_by_shard(
    arrays: Mapping[str, ArrayMeta], by_key: Mapping[str, str], num_shards: int
) -> dict[int, dict[str, str]]:
    """The other way: shard -> {array: hash}, for the first `num_shards` shards `by_key` names."""
    found: dict[int, dict[str, str]] = {}
    for shard in range(num_shards):
        for name, arr in arrays.items():
            if arr.shard_key(shard) in by_key:
                found.setdefault(shard, {})[name] = by_key[arr.shard_key(shard)]
    return found


def content_digest(
    files: DatasetFiles, arrays: Mapping[str, ArrayMeta], attrs: DatasetAttrs, known: Mapping[str, str] | None = None
) -> tuple[str, dict[str, str]]:
    """The digest of the dataset in `files` whose final attributes are `attrs` (their own
    `digest` left out), and each shard file's SHA-256: taken from `known` where given, else read.
    A shard file that is missing counts as such."""
    keys = shard_keys(arrays, attrs.num_samples)
    known = known or {}
    todo = [key for name in sorted(keys) for key in keys[name] if key not in known]
    with ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="batchctl-digest") as pool:
        read = dict(zip(todo, pool.map(lambda key: _file_sha256(files, key), todo), strict=True))
    shards = {key: known.get(key) or read[key] for name in keys for key in keys[name]}
    whole = hashlib.sha256(f"batchctl dataset digest {DIGEST_VERSION}\n".encode())
    for name in sorted(keys):
        whole.update(f"{name}/{ZARR_JSON} {_file_sha256(files, f'{name}/{ZARR_JSON}')}\n".encode())
        for key in keys[name]:
            whole.update(f"{key} {shards[key]}\n".encode())
    own = json.dumps(dataclasses.asdict(dataclasses.replace(attrs, digest="")), sort_keys=True, separators=(",", ":"))
    whole.update(f"attributes {hashlib.sha256(own.encode()).hexdigest()}\n".encode())
    return whole.hexdigest(), shards


def _file_sha256(files: DatasetFiles, key: str) -> str:
    """Read in pieces (a shard may be 128 MiB or more; memory stays a few hundred KiB a thread)."""
    try:
        if files.remote:
            fs, root = storage.locate(files.location, files.storage_options)
            with fs.open(f"{root}/{key}", "rb") as remote:
                return hashlib.file_digest(remote, "sha256").hexdigest()
        with open_regular(Path(files.location) / key) as local:
            return hashlib.file_digest(local, "sha256").hexdigest()
    except FileNotFoundError:
        return "missing"
    except NotRegularFile:
        return "not a regular file"


def shard_problem(files: DatasetFiles, key: str, per_shard: int, sha256: str | None) -> str | None:
    """Why the shard file `key` is not the one a build wrote, or None: not its SHA-256 (`sha256`,
    where known: the whole file is read), else an index that does not read or chunks that do not
    end where the index does (one ranged read of its index, as on an object store)."""
    if sha256 is not None:
        found = _file_sha256(files, key)
        if found == sha256:
            return None
        return found if found in ("missing", "not a regular file") else "its bytes are not those it was written with"
    try:
        size = files.size(key)
        if size < 0:
            return "missing"
        raw = files.read_range(key, size - (per_shard * 16 + 4), size) if size >= per_shard * 16 + 4 else b""
        index = parse_shard_index(raw, per_shard)
    except NotRegularFile:
        return "not a regular file"
    except (OSError, FormatError) as exc:
        return str(exc)
    present = index[index[:, 0] != NO_CHUNK]
    end = int((present[:, 0] + present[:, 1]).max()) if len(present) else 0
    if end + per_shard * 16 + 4 != size:
        return f"it holds {size} bytes, its index says {end + per_shard * 16 + 4}"
    return None
