"""Inspect: what a dataset holds (`info`) and whether every byte of it reads back (`verify`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from batchctl.errors import FormatError
from batchctl.read.reader import Dataset
from batchctl.store import codec, metadata, storage, zarrmeta
from batchctl.store.digest import published_digest
from batchctl.store.journal import Untrusted
from batchctl.store.record import check_fits, read_record
from batchctl.store.untrusted import parse_json


def info(path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Counts, fields and their layout, compression ratio, bytes on disk, class histogram, build options."""
    ds = Dataset(path, allow_partial=True, storage_options=storage_options)
    attrs = ds.attrs
    build = metadata.read_build_info(ds.path, ds.storage_options)  # None for a dataset of format version 2
    if build is not None and build.digest != attrs.digest:
        build = None  # not this version's
    fields = {}
    for name, arr in ds.arrays.items():
        stored = storage.tree_bytes(f"{ds.path}/{name}", ds.storage_options)
        # what the stored chunks hold uncompressed: whole batches (the last one padded), so a field
        # stored raw shows 1.0 however short its last batch
        row_bytes = int(np.prod(arr.shape[1:])) * arr.dtype.itemsize
        raw = ds.num_batches * ds.batch_size * row_bytes
        if metadata.stores_batches(name):  # a ragged field's values: what the stored chunks hold
            raw = _chunk_bytes(ds, name, arr)
        chunk_bytes = _chunk_bytes(ds, name, arr)
        fields[name] = {
            "shape": list(arr.shape[1:]),  # as stored, as every Zarr reader sees it
            "dtype": str(arr.dtype),
            "chunk_rows": int(arr.chunks[0]),
            "shard_rows": int(arr.shards[0]) if arr.shards else None,
            "codecs": [c.to_dict()["name"] for c in arr.metadata.codecs[0].codecs]  # type: ignore[union-attr]
            if arr.shards
            else [],
            "stored_bytes": stored,
            "ratio": round(raw / chunk_bytes, 2) if raw and chunk_bytes else None,
            "note": _array_note(ds, name),
        }
    histogram = None
    if ds.classes is not None and metadata.LABEL in ds.arrays:
        labels = [ds.read_field(metadata.LABEL, i) for i in range(ds.num_batches)]  # damage: a FormatError
        counts = np.bincount(np.concatenate(labels) if labels else [], minlength=len(ds.classes))
        histogram = {name: int(n) for name, n in zip(ds.classes, counts, strict=False)}
    return {
        "path": ds.path,
        "complete": attrs.complete,
        "num_samples": ds.num_samples,
        "num_batches": ds.num_batches,
        "batch_size": ds.batch_size,
        "shard_batches": attrs.shard_batches,
        "num_shards": attrs.num_shards,
        "fields": fields,
        "classes": ds.classes,
        "class_counts": histogram,
        "bytes": storage.tree_bytes(ds.path, ds.storage_options),
        "compression": attrs.compression,
        "preprocess": attrs.preprocess,
        "errors": attrs.errors,
        "skipped": [{"source": source, "error": error} for source, error in attrs.skipped],
        "ignored": attrs.ignored,
        "ignored_paths": attrs.ignored_paths,
        "digest": attrs.digest,
        "source": build.source if build else None,
        "batchctl_version": build.batchctl_version if build else None,
        "format_version": attrs.format_version,
    }


def _array_note(ds: Dataset, name: str) -> str | None:
    """What an array is, where its name does not say: `source`'s encoding, a ragged field's parts."""
    field_name, part = metadata.ragged_part(name)
    if name == metadata.SOURCE:
        return "UTF-8 paths, zero-padded"
    if name in ds.texts:
        return "UTF-8 text, zero-padded"
    if part == metadata.OFFSETS_SUFFIX:
        return f"ragged {field_name}: each sample's [start, stop) in its batch's row of values"
    if part == metadata.VALUES_SUFFIX:
        encoding = ds.encodings.get(field_name)
        encoded = f": {encoding} (decode with loader(random_resized_crop=... or center_crop=...))" if encoding else ""
        return f"ragged {field_name}'s values, a row per batch{encoded}"
    return None


def _consolidated_problems(ds: Dataset) -> list[Problem]:
    """The group's consolidated copy of the arrays' documents must be theirs: xarray and zarr
    open the arrays from it alone."""
    files = zarrmeta.DatasetFiles(ds.path, ds.storage_options)
    try:
        copy = parse_json(files.read(zarrmeta.ZARR_JSON)).get("consolidated_metadata")
    except (OSError, ValueError, AttributeError) as exc:
        return [Problem(zarrmeta.ZARR_JSON, f"cannot be read again ({exc})")]
    if copy is None:
        return []
    documents = copy.get("metadata") if isinstance(copy, dict) else None
    if not isinstance(documents, dict):
        return [Problem(zarrmeta.ZARR_JSON, "its consolidated_metadata has no metadata")]
    problems = []
    for name in sorted(set(ds.arrays) | set(documents)):
        try:
            own = parse_json(files.read(f"{name}/{zarrmeta.ZARR_JSON}"))
        except (OSError, ValueError):
            own = None
        if documents.get(name) != own:
            problems.append(
                Problem(name, f"the group's consolidated metadata differs from {name}/{zarrmeta.ZARR_JSON}")
            )
    return problems


def _digest_problems(ds: Dataset) -> list[Problem]:
    """The content digest recomputed from the files must be the one the dataset was published
    with (a dataset of format version 2 has none), and the build's notes must be that build's."""
    if ds.attrs.format_version < 3 or not ds.attrs.complete:
        return []
    files = zarrmeta.DatasetFiles(ds.path, ds.storage_options)
    problem, shards = published_digest(files, ds.attrs)
    if problem is not None:
        return [Problem(zarrmeta.ZARR_JSON, problem)]
    return _notes_problems(ds, files, shards)


def _notes_problems(ds: Dataset, files: zarrmeta.DatasetFiles, shards: Mapping[str, str]) -> list[Problem]:
    """The build info and the record: no reader reads them, but the next build trusts them (a
    damaged one costs it a full rebuild). The build info must be of batchctl's form, name this
    digest and hold each shard file's hash as read; the record must be the one it vouches for
    (`record_sha256`), of batchctl's form, describing this dataset."""
    try:
        raw = files.read(metadata.BUILD_INFO)
    except FileNotFoundError:
        return [Problem(metadata.BUILD_INFO, "is missing (the next build builds everything)")]
    except OSError as exc:
        return [Problem(metadata.BUILD_INFO, f"cannot be read ({exc.strerror or exc})")]
    info = metadata.parse_build_info(raw)
    if info is None:
        return [Problem(metadata.BUILD_INFO, "is not of batchctl's form")]
    if info.digest != ds.attrs.digest:
        return [Problem(metadata.BUILD_INFO, f"names the digest {info.digest}, not the dataset's {ds.attrs.digest}")]
    if info.shards != shards:
        wrong = sorted(key for key in set(info.shards) | set(shards) if info.shards.get(key) != shards.get(key))
        named = ", ".join(wrong[:3]) + (f" and {len(wrong) - 3} more" if len(wrong) > 3 else "")
        return [Problem(metadata.BUILD_INFO, f"its hashes of the shard files differ from the files: {named}")]
    where = f"{ds.path}/{metadata.RECORD}"
    try:
        record = read_record(where, ds.storage_options, ds.attrs.digest, info.record_sha256)
        if record is None:
            return [Problem(metadata.RECORD, "is missing (the next build builds everything)")]
        check_fits(record, ds.attrs, int(ds.arrays[metadata.SOURCE].shape[1]))
    except Untrusted as exc:
        return [Problem(metadata.RECORD, str(exc))]
    return []


def _chunk_bytes(ds: Dataset, name: str, arr: Any) -> int:
    """The bytes of an array's stored chunks: its shard files less their indexes."""
    shards = ds.attrs.num_shards if arr.shards else 0
    index_bytes = zarrmeta.ArrayMeta.of_zarr(arr).chunks_per_shard * 16 + 4 if arr.shards else 0
    return storage.tree_bytes(f"{ds.path}/{name}/c", ds.storage_options) - shards * index_bytes


@dataclass(frozen=True)
class Problem:
    where: str
    what: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


def verify(
    path: str | os.PathLike[str],
    on_batch: Callable[[], None] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> list[Problem]:
    """Read every chunk of every array as a reader does, checking checksums, shapes, counts and
    unique sources.

    Returns the problems found (empty when the dataset is sound). Shard files are counted and
    each shard's index is checked first (a missing shard or chunk would read back as fill values
    through zarr-python); batches are then read through the reader's own path (`Dataset.read_field`).
    The work is bounded by the files there, whatever counts the metadata claims.
    """
    ds = Dataset(path, allow_partial=True, storage_options=storage_options)
    present = _stored_keys(ds)
    problems: list[Problem] = []
    if not ds.attrs.complete:
        problems.append(Problem(str(path), "not marked complete (its build did not finish)"))
    shard_rows = ds.attrs.layout.shard_rows
    if not shard_rows:
        return [*problems, Problem(str(path), "shard_batches is 0: no layout to check")]
    num_shards = -(-ds.num_samples // shard_rows)
    readable: set[int] | None = None  # the shards every array has, with an index that reads
    all_there = True
    for name, arr in ds.arrays.items():
        per_batch = metadata.stores_batches(name)  # a ragged field's values: a row per batch
        rows, chunk_rows = (ds.num_batches, 1) if per_batch else (ds.num_samples, ds.batch_size)
        if arr.shape[0] != rows:
            problems.append(Problem(name, f"has {arr.shape[0]} rows, the metadata says {rows}"))
        if arr.chunks[0] != chunk_rows or (arr.shards and arr.shards[0] * ds.batch_size // chunk_rows != shard_rows):
            problems.append(Problem(name, f"chunks {arr.chunks} / shards {arr.shards} break the batch layout"))
        stored = zarrmeta.ArrayMeta.of_zarr(arr)
        have = {shard for shard in _shards_stored(stored, present) if shard < num_shards}
        problems += _missing_shards(name, have, num_shards)
        all_there = all_there and len(have) == num_shards
        have = {shard for shard in have if not _index_problems(ds, stored, shard, problems)}
        readable = have if readable is None else readable & have
    problems += _consolidated_problems(ds)
    if all_there:  # else the digest cannot match, and its list of shards is the metadata's claim, not the disk's
        problems += _digest_problems(ds)
    spec = ds.attrs.schema
    seen: set[tuple[str, int]] = set()
    per_shard = shard_rows // ds.batch_size
    for shard in sorted(readable or ()):
        for index in range(shard * per_shard, min((shard + 1) * per_shard, ds.num_batches)):
            problems += _batch_problems(ds, index, shard, spec, seen)
            if on_batch is not None:
                on_batch()
    return problems


MAX_LISTED = 20  # missing shards named one by one, then a count


def _shards_stored(arr: zarrmeta.ArrayMeta, present: set[str]) -> set[int]:
    """The shard numbers of `arr` whose files (objects) are there."""
    found = set()
    for key in present:
        if key.startswith(f"{arr.name}/"):
            parts = key[len(arr.name) + 1 :].split(arr.separator)
            number = parts[1 if arr.key_prefix else 0] if len(parts) > 1 else ""
            if number.isdigit() and arr.shard_key(int(number)) == key:
                found.add(int(number))
    return found


def _missing_shards(name: str, have: set[int], num_shards: int) -> list[Problem]:
    count = num_shards - len(have)
    if not count:
        return []
    named = []
    for shard in range(num_shards):
        if shard not in have:
            named.append(Problem(f"{name} shard {shard}", "shard file is missing"))
            if len(named) == MAX_LISTED:
                break
    if count > len(named):
        named.append(Problem(name, f"... {count - len(named)} more shard files are missing"))
    return named


def _index_problems(ds: Dataset, arr: zarrmeta.ArrayMeta, shard: int, problems: list[Problem]) -> bool:
    """Check shard `shard`'s index: there whole, its checksum right, every batch the dataset holds
    in it present and within the file. Adds what is wrong to `problems`; True when it cannot be read."""
    where = f"{arr.name} shard {shard}"
    try:
        entries = _read_index(ds, arr, shard, arr.chunks_per_shard)
    except (OSError, FormatError) as exc:
        problems.append(Problem(where, str(exc)))
        return True
    if entries is None:
        problems.append(Problem(where, "the shard file is too short to hold its index"))
        return True
    size, index = entries
    per_shard = int(arr.grid[0]) // int(arr.chunks[0])
    per_batch = len(index) // per_shard  # a ragged field's values: a batch spans several positions
    first = shard * per_shard
    for position in range(min(per_shard, ds.num_batches - first) * per_batch):
        offset, nbytes = (int(v) for v in index[position])
        if offset == codec.NO_CHUNK and per_batch > 1:
            continue  # a batch's values take the chunks they need, none for a batch of empty rows
        if offset == codec.NO_CHUNK:
            problems.append(Problem(where, f"batch {first + position} is missing from the shard"))
        elif offset + nbytes > size:
            problems.append(
                Problem(where, f"batch {first + position // per_batch} lies past the end of the shard file")
            )
    return False


def _read_index(ds: Dataset, arr: zarrmeta.ArrayMeta, shard: int, per_shard: int) -> tuple[int, np.ndarray] | None:
    """(bytes before the index, the index) of a shard, from one ranged read; None when the file is
    shorter than its index."""
    fs, root = storage.locate(ds.path, ds.storage_options)
    where = f"{root}/{arr.shard_key(shard)}"
    nbytes = per_shard * 16 + 4
    size = int(fs.size(where))
    if size < nbytes:
        return None
    raw = bytes(fs.cat_file(where, start=size - nbytes, end=size))
    return size - nbytes, codec.parse_shard_index(raw, per_shard)


def _batch_problems(
    ds: Dataset, index: int, shard: int, spec: Mapping[str, metadata.FieldSpec], seen: set[tuple[str, int]]
) -> list[Problem]:
    problems = []
    batch = {}
    for name in ds.fields:
        try:
            batch[name] = ds.read_field(name, index)
        except Exception as exc:  # noqa: BLE001 - any decode failure is corruption of this chunk
            problems.append(Problem(f"{name} batch {index} (shard {shard})", f"unreadable: {exc}"))
            continue
        if name in spec and spec[name].ragged:
            problems += _ragged_problems(name, index, batch[name], spec[name])
        elif name in spec and name not in ds.texts and batch[name].shape[1:] != spec[name].shape:
            problems.append(Problem(f"{name} batch {index}", f"rows of shape {batch[name].shape[1:]}"))
    if metadata.SOURCE in batch and metadata.SOURCE_INDEX in batch:
        for source, row in zip(batch[metadata.SOURCE], batch[metadata.SOURCE_INDEX], strict=True):
            key = (str(source), int(row))
            if key in seen:
                problems.append(Problem(f"batch {index}", f"{key[0]} row {key[1]} appears twice"))
            seen.add(key)
    return problems


def _ragged_problems(name: str, index: int, rows: np.ndarray, spec: metadata.FieldSpec) -> list[Problem]:
    """A ragged field's rows must be of its row shape past their first dimension."""
    for row in rows:
        if row.shape[1:] != spec.shape or row.dtype != np.dtype(spec.dtype):
            return [Problem(f"{name} batch {index}", f"a row of shape {row.shape} {row.dtype}")]
    return []


def _stored_keys(ds: Dataset) -> set[str]:
    """Keys (relative to the dataset root) of every object stored, local or remote."""
    fs, root = storage.locate(ds.path, ds.storage_options)
    return {name[len(root.rstrip("/")) + 1 :] for name in fs.find(root)}
