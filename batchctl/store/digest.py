"""A dataset's content digest: one SHA-256 over its arrays' documents, every shard file's bytes
and its batchctl attributes (docs/format.md, "The digest"). Two builds of the same files with
the same options give the same digest whatever their workers, engine or interruptions; a
build publishes it (`digest` in the attributes, the report and `info`), `verify` recomputes it.

A shard file's hash is a tree: one hash over the hash of each of its chunks in index order and
of its index (`shard_hash`: BLAKE3 since digest 3, SHA-256 in digest 2), so the chunks can be
hashed where they are encoded, many at once (the collator's writer threads), and no one thread
hashes every byte a build writes. A build does not read its shards back for it: the collator
combines the chunk hashes as it places them (`journal.ShardDone.hashes`), and an incremental
build takes the hashes of the shards it keeps from the last build's info; only a shard no one
hashed whole (resumed half-written, or written by Dask tasks) is read here. A hash of another
scheme (digest 2's, or an earlier batchctl's whole-file SHA-256) is not used for the digest:
the shard is read again. A dataset published with digest 2 still verifies
(`published_digest`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from batchctl.errors import FormatError
from batchctl.store import storage
from batchctl.store.codec import NO_CHUNK, parse_shard_index
from batchctl.store.metadata import DatasetAttrs, num_batches
from batchctl.store.shardhash import OLD_SHARD_HASH, SHARD_HASH, chunk_digest, ours, scheme_of, shard_hash
from batchctl.store.untrusted import NotRegularFile, open_regular
from batchctl.store.zarrmeta import ZARR_JSON, ArrayMeta, DatasetFiles

DIGEST_VERSION = 3
SCHEMES = {DIGEST_VERSION: SHARD_HASH, 2: OLD_SHARD_HASH}  # each digest version's shard hashes (docs/format.md)
HASH_THREADS = 8  # the hashes let go of the GIL on big buffers: the shards are read and hashed side by side


def shard_keys(arrays: Mapping[str, ArrayMeta], attrs: DatasetAttrs) -> dict[str, list[str]]:
    """Every shard file a dataset holds, by array, in shard order (a ragged field's values too:
    every array has a shard per `shard_batches` batches)."""
    shards = num_batches(attrs.num_samples, attrs.layout.shard_rows) if attrs.shard_batches else 0
    return {name: [arr.shard_key(shard) for shard in range(shards)] for name, arr in arrays.items()}


def hashes_by_key(arrays: Mapping[str, ArrayMeta], by_shard: Mapping[int, Mapping[str, str]]) -> dict[str, str]:
    """Shard files' hashes by file key, from the journal's shape (shard -> {array: hash});
    `content_digest` uses those of its own scheme (a shard of another is read again)."""
    return {
        arrays[name].shard_key(shard): found
        for shard, hashes in by_shard.items()
        for name, found in hashes.items()
        if name in arrays
    }


def hashes_by_shard(
    arrays: Mapping[str, ArrayMeta], by_key: Mapping[str, str], num_shards: int
) -> dict[int, dict[str, str]]:
    """The other way: shard -> {array: hash}, for the first `num_shards` shards `by_key` names
    with a hash of chunk hashes (digest 2's too: it still vouches for a kept shard's bytes,
    `shard_problem`, though the digest reads such a shard again)."""
    found: dict[int, dict[str, str]] = {}
    for shard in range(num_shards):
        for name, arr in arrays.items():
            if arr.shard_key(shard) in by_key and scheme_of(by_key[arr.shard_key(shard)]) is not None:
                found.setdefault(shard, {})[name] = by_key[arr.shard_key(shard)]
    return found


def content_digest(
    files: DatasetFiles,
    arrays: Mapping[str, ArrayMeta],
    attrs: DatasetAttrs,
    known: Mapping[str, str] | None = None,
    version: int = DIGEST_VERSION,
) -> tuple[str, dict[str, str]]:
    """The digest (of `version`) of the dataset in `files` whose final attributes are `attrs`
    (their own `digest` left out), and each shard file's hash (`shard_hash`): taken from `known`
    where given, else read. A shard file that is missing counts as such."""
    keys = shard_keys(arrays, attrs)
    scheme = SCHEMES[version]
    known = {key: found for key, found in (known or {}).items() if ours(found, scheme)}
    per_shard = {key: arr.chunks_per_shard for name, arr in arrays.items() for key in keys[name]}
    todo = [key for name in sorted(keys) for key in keys[name] if key not in known]
    with ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="batchctl-digest") as pool:
        hashed = pool.map(lambda key: shard_file_hash(files, key, per_shard[key], scheme), todo)
        read = dict(zip(todo, hashed, strict=True))
    shards = {key: known.get(key) or read[key] for name in keys for key in keys[name]}
    whole = hashlib.sha256(f"batchctl dataset digest {version}\n".encode())
    for name in sorted(keys):
        whole.update(f"{name}/{ZARR_JSON} {_file_sha256(files, f'{name}/{ZARR_JSON}')}\n".encode())
        for key in keys[name]:
            whole.update(f"{key} {shards[key]}\n".encode())
    own = json.dumps(dataclasses.asdict(dataclasses.replace(attrs, digest="")), sort_keys=True, separators=(",", ":"))
    whole.update(f"attributes {hashlib.sha256(own.encode()).hexdigest()}\n".encode())
    return whole.hexdigest(), shards


def _file_sha256(files: DatasetFiles, key: str) -> str:
    """A document's SHA-256 (an array's `zarr.json`), read in pieces."""
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


def published_digest(files: DatasetFiles, attrs: DatasetAttrs) -> tuple[str | None, dict[str, str]]:
    """Why the digest recomputed from the files is not the one the dataset was published with
    (None when it is: this version's digest, else digest 2's, a dataset published before digest
    3; only then, or on damage, are the files read twice), and the shard files' hashes of the
    digest that matched (this version's when neither did)."""
    arrays = files.arrays()
    found, shards = content_digest(files, arrays, attrs)
    if found == attrs.digest:
        return None, shards
    older, older_shards = content_digest(files, arrays, attrs, version=2)
    if older == attrs.digest:
        return None, older_shards
    return f"the content digest is {found}, not the {attrs.digest} it was published with", shards


def shard_file_hash(files: DatasetFiles, key: str, per_shard: int, scheme: str = SHARD_HASH) -> str:
    """The shard file `key`'s hash (`shard_hash` of `scheme`), read from the file: its index,
    then each of its chunks (in pieces of at most a chunk). "missing", "not a regular file", or
    a hash of no scheme (`damaged: ...`) where the file is not a shard whose chunks and index
    tile it."""
    try:
        with _reader(files, key) as (size, read):
            try:
                raw, present = _index_of(size, read, per_shard)
            except FormatError:
                return "damaged: its index does not read"
            ends = sorted((int(offset), int(offset + length)) for offset, length in present)
            starts = [0, *(end for _, end in ends[:-1])] if ends else []  # (a ragged field's shard may hold none)
            if [start for start, _ in ends] != starts or (ends[-1][1] if ends else 0) + len(raw) != size:
                return "damaged: its chunks and index do not tile it"
            return shard_hash((chunk_digest([read(int(o), int(o + n))], scheme) for o, n in present), raw, scheme)
    except FileNotFoundError:
        return "missing"
    except NotRegularFile:
        return "not a regular file"


def _index_of(size: int, read: Callable[[int, int], bytes], per_shard: int) -> tuple[bytes, np.ndarray]:
    """A shard file's index bytes (read from its end) and its present chunks' (offset, nbytes),
    in index order; a FormatError when the index does not read."""
    nbytes = per_shard * 16 + 4
    raw = read(size - nbytes, size) if size >= nbytes else b""
    index = parse_shard_index(raw, per_shard)
    return raw, index[index[:, 0] != NO_CHUNK]


@contextlib.contextmanager
def _reader(files: DatasetFiles, key: str) -> Iterator[tuple[int, Callable[[int, int], bytes]]]:
    """The object `key` opened once: its size and a reader of byte ranges."""
    if files.remote:
        fs, root = storage.locate(files.location, files.storage_options)
        with fs.open(f"{root}/{key}", "rb") as remote:

            def read_remote(start: int, end: int) -> bytes:
                remote.seek(start)
                return bytes(remote.read(end - start))

            yield int(remote.size), read_remote
        return
    with open_regular(Path(files.location) / key) as local:
        yield os.fstat(local.fileno()).st_size, lambda start, end: os.pread(local.fileno(), end - start, start)


def shard_problem(files: DatasetFiles, key: str, per_shard: int, known: str | None) -> str | None:
    """Why the shard file `key` is not the one a build wrote, or None: not its hash (`known`,
    where it is of a scheme of chunk hashes, this digest's or digest 2's: the whole file is
    read), else an index that does not read or chunks that do not end where the index does (one
    ranged read of its index, as on an object store)."""
    scheme = None if known is None else scheme_of(known)
    if scheme is not None:
        found = shard_file_hash(files, key, per_shard, scheme)
        if found == known:
            return None
        return found if found in ("missing", "not a regular file") else "its bytes are not those it was written with"
    try:
        with _reader(files, key) as (size, read):
            raw, present = _index_of(size, read, per_shard)
    except FileNotFoundError:
        return "missing"
    except NotRegularFile:
        return "not a regular file"
    except (OSError, FormatError) as exc:
        return str(exc)
    end = int((present[:, 0] + present[:, 1]).max()) if len(present) else 0
    if end + len(raw) != size:
        return f"it holds {size} bytes, its index says {end + len(raw)}"
    return None
