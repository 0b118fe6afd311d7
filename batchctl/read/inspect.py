"""Inspect: what a dataset holds (`info`) and whether every byte of it reads back (`verify`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from batchctl.read.reader import Dataset
from batchctl.store import format as fmt, storage


def info(path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Counts, fields and their layout, compression ratio, bytes on disk, class histogram, build options."""
    ds = Dataset(path, allow_partial=True, storage_options=storage_options)
    attrs = ds.attrs
    fields = {}
    for name, arr in ds.arrays.items():
        stored = storage.tree_bytes(f"{ds.path}/{name}", ds.storage_options)
        # what the stored chunks hold uncompressed: whole batches (the last one padded), so a field
        # stored raw shows 1.0 however short its last batch
        row_bytes = int(np.prod(arr.shape[1:])) * arr.dtype.itemsize
        raw = ds.num_batches * ds.batch_size * row_bytes
        chunk_bytes = _chunk_bytes(ds, name, arr)
        fields[name] = {
            "shape": [] if name == fmt.SOURCE else list(arr.shape[1:]),
            "dtype": "str" if name == fmt.SOURCE else str(arr.dtype),  # source: UTF-8 bytes, zero-padded
            "chunk_rows": int(arr.chunks[0]),
            "shard_rows": int(arr.shards[0]) if arr.shards else None,
            "codecs": [c.to_dict()["name"] for c in arr.metadata.codecs[0].codecs]  # type: ignore[union-attr]
            if arr.shards
            else [],
            "stored_bytes": stored,
            "ratio": round(raw / chunk_bytes, 2) if raw and chunk_bytes else None,
        }
    histogram = None
    if ds.classes is not None and fmt.LABEL in ds.arrays:
        labels = [ds.read_field(fmt.LABEL, i) for i in range(ds.num_batches)]  # damage: a FormatError
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
        "source": attrs.source,
        "created": attrs.created,
        "batchctl_version": attrs.batchctl_version,
        "format_version": attrs.format_version,
    }


def _chunk_bytes(ds: Dataset, name: str, arr: Any) -> int:
    """The bytes of an array's stored chunks: its shard files less their indexes."""
    shards = -(-ds.num_samples // int(arr.shards[0])) if arr.shards else 0
    index_bytes = (int(arr.shards[0]) // int(arr.chunks[0]) * 16 + 4) if arr.shards else 0
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
    """Read every chunk of every array, checking checksums, shapes, counts and unique sources.

    Returns the problems found (empty when the dataset is sound). A missing shard file would read
    back as fill values, so shard files are counted too.
    """
    ds = Dataset(path, allow_partial=True, storage_options=storage_options)
    present = _stored_keys(ds)
    problems: list[Problem] = []
    if not ds.attrs.complete:
        problems.append(Problem(str(path), "not marked complete (its build did not finish)"))
    shard_rows = ds.attrs.layout.shard_rows
    num_shards = -(-ds.num_samples // shard_rows) if shard_rows else 0
    for name, arr in ds.arrays.items():
        if arr.shape[0] != ds.num_samples:
            problems.append(Problem(name, f"has {arr.shape[0]} rows, the metadata says {ds.num_samples}"))
        if arr.chunks[0] != ds.batch_size or (arr.shards and arr.shards[0] != shard_rows):
            problems.append(Problem(name, f"chunks {arr.chunks} / shards {arr.shards} break the batch layout"))
        stored = fmt.ArrayMeta.of_zarr(arr)
        for shard in range(num_shards):
            if stored.shard_key(shard) not in present:
                problems.append(Problem(f"{name} shard {shard}", "shard file is missing"))
    spec = {name: fmt.FieldSpec(tuple(s), d) for name, s, d in _field_specs(ds)}
    seen: set[tuple[str, int]] = set()
    for index in range(ds.num_batches):
        shard = index * ds.batch_size // shard_rows if shard_rows else 0
        start, stop = index * ds.batch_size, min((index + 1) * ds.batch_size, ds.num_samples)
        batch = {}
        for name, arr in ds.arrays.items():
            try:
                batch[name] = np.asarray(arr[start:stop])
                if name == fmt.SOURCE:
                    batch[name] = fmt.decode_sources(batch[name])
            except Exception as exc:  # noqa: BLE001 - any decode failure is corruption of this chunk
                problems.append(Problem(f"{name} batch {index} (shard {shard})", f"unreadable: {exc}"))
                continue
            if name in spec and batch[name].shape[1:] != spec[name].shape:
                problems.append(Problem(f"{name} batch {index}", f"rows of shape {batch[name].shape[1:]}"))
        if fmt.SOURCE in batch and fmt.SOURCE_INDEX in batch:
            for source, row in zip(batch[fmt.SOURCE], batch[fmt.SOURCE_INDEX], strict=True):
                key = (str(source), int(row))
                if key in seen:
                    problems.append(Problem(f"batch {index}", f"{key[0]} row {key[1]} appears twice"))
                seen.add(key)
        if on_batch is not None:
            on_batch()
    return problems


def _stored_keys(ds: Dataset) -> set[str]:
    """Keys (relative to the dataset root) of every object stored, local or remote."""
    fs, root = storage.locate(ds.path, ds.storage_options)
    return {name[len(root.rstrip("/")) + 1 :] for name in fs.find(root)}


def _field_specs(ds: Dataset) -> list[tuple[str, list[int], str]]:
    return [(name, f["shape"], f["dtype"]) for name, f in ds.attrs.fields.items()]
