"""The on-disk format, enforced here and nowhere else (docs/format.md describes it).

A dataset is a Zarr v3 group. Every array has one row per sample, is chunked by exactly
`batch_size` rows (one chunk = one batch) and sharded by `shard_batches` chunks. Shards are only
ever written whole, once, by one writer: zarr 3.1 rewrites a whole shard for any write into it and
has no locking, so partial writes from several processes lose rows (shared/FACTS.md).
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zarr
import zarr.codecs as zc

from batchctl.errors import FormatError, IncompleteDatasetError

FORMAT_VERSION = 1
ATTRS_KEY = "batchctl"
SOURCE = "source"
SOURCE_INDEX = "source_index"
LABEL = "label"
RESERVED_FIELDS = (SOURCE, SOURCE_INDEX, LABEL)
COMPRESSIONS = ("zstd", "blosc", "none")
ZSTD_LEVEL = 3
DEFAULT_SHARD_BYTES = 128 * 2**20
MIN_SHARD_BATCHES = 2


@dataclass(frozen=True)
class FieldSpec:
    """Shape and dtype of one sample of a field (the row shape, without the leading N)."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def of(cls, value: np.ndarray) -> FieldSpec:
        return cls(
            tuple(int(n) for n in value.shape), value.dtype.str if value.dtype.byteorder == ">" else value.dtype.name
        )


Schema = dict[str, FieldSpec]


@dataclass(frozen=True)
class Layout:
    """How rows map onto chunks and shard files."""

    batch_size: int
    shard_batches: int

    @property
    def shard_rows(self) -> int:
        return self.batch_size * self.shard_batches


def default_shard_batches(batch_size: int, schema: Schema) -> int:
    """About DEFAULT_SHARD_BYTES of uncompressed data per shard, at least MIN_SHARD_BATCHES."""
    row_bytes = sum(spec.row_bytes for spec in schema.values()) + 16
    return max(MIN_SHARD_BATCHES, DEFAULT_SHARD_BYTES // (batch_size * row_bytes))


def parse_compression(name: str) -> str:
    if name not in COMPRESSIONS:
        raise FormatError(f"Expected compression one of {', '.join(COMPRESSIONS)}, got {name!r} instead.")
    return name


def _compressors(compression: str) -> list[Any]:
    """Every chunk carries a checksum: zstd's own frame checksum, or a crc32c codec after blosc/none."""
    if compression == "zstd":
        return [zc.ZstdCodec(level=ZSTD_LEVEL, checksum=True)]
    if compression == "blosc":
        return [zc.BloscCodec(cname="zstd", clevel=ZSTD_LEVEL, shuffle="shuffle"), zc.Crc32cCodec()]
    return [zc.Crc32cCodec()]


@dataclass
class DatasetAttrs:
    """The group attributes under "batchctl"; `complete` is set true last of all."""

    batch_size: int
    shard_batches: int
    fields: dict[str, dict[str, Any]]
    classes: list[str] | None
    preprocess: dict[str, Any]
    compression: str
    batchctl_version: str
    created: str
    source: str
    fingerprint: str = ""
    complete: bool = False
    num_samples: int = 0
    num_batches: int = 0
    num_shards: int = 0
    errors: int = 0
    ignored: int = 0
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> DatasetAttrs:
        version = raw.get("format_version")
        if version != FORMAT_VERSION:
            raise FormatError(f"Expected batchctl format_version {FORMAT_VERSION}, got {version!r} instead.")
        known = {f for f in cls.__dataclass_fields__}
        try:
            return cls(**{k: v for k, v in raw.items() if k in known})
        except TypeError as exc:
            raise FormatError(f"batchctl attributes are incomplete: {exc}") from exc

    @property
    def layout(self) -> Layout:
        return Layout(self.batch_size, self.shard_batches)


def num_batches(num_samples: int, batch_size: int) -> int:
    return -(-num_samples // batch_size)


def create_arrays(
    group: zarr.Group, schema: Schema, layout: Layout, compression: str, labelled: bool
) -> dict[str, zarr.Array]:
    """Create every array empty (shape 0); rows are added shard by shard with `write_shard`."""
    columns: dict[str, tuple[tuple[int, ...], Any]] = {name: (spec.shape, spec.dtype) for name, spec in schema.items()}
    if labelled:
        columns[LABEL] = ((), "int64")
    columns[SOURCE] = ((), str)
    columns[SOURCE_INDEX] = ((), "int64")
    arrays = {}
    for name, (row_shape, dtype) in columns.items():
        arrays[name] = group.create_array(
            name,
            shape=(0, *row_shape),
            dtype=dtype,
            chunks=(layout.batch_size, *row_shape),
            shards=(layout.shard_rows, *row_shape),
            compressors=_compressors(compression),
            dimension_names=("sample", *(f"dim_{i}" for i in range(len(row_shape)))),
            config={"write_empty_chunks": True},  # every shard is a file, even all-zero ones
        )
    return arrays


def open_arrays(group: zarr.Group) -> dict[str, zarr.Array]:
    return {name: arr for name, arr in group.arrays()}


def write_shard(
    arrays: Mapping[str, zarr.Array], layout: Layout, shard_index: int, columns: Mapping[str, np.ndarray]
) -> None:
    """Write shard `shard_index` of every array in one aligned, whole-shard write each.

    `columns` holds up to `shard_rows` rows per array; fewer only for the final shard, after
    which the arrays end exactly at the last row.
    """
    start = shard_index * layout.shard_rows
    rows = len(next(iter(columns.values())))
    for name, arr in arrays.items():
        data = columns[name]
        if len(data) != rows:
            raise FormatError(f"shard {shard_index}: column {name} has {len(data)} rows, expected {rows}")
        arr.resize((start + rows, *arr.shape[1:]))
        arr[start : start + rows] = data


def truncate(arrays: Mapping[str, zarr.Array], layout: Layout, root: Path, num_shards: int) -> None:
    """Drop everything past the first `num_shards` whole shards (shard files included), for resume."""
    rows = num_shards * layout.shard_rows
    for name, arr in arrays.items():
        arr.resize((rows, *arr.shape[1:]))
        shard_dir = root / name / "c"
        if shard_dir.is_dir():
            for entry in shard_dir.iterdir():
                if entry.name.isdigit() and int(entry.name) >= num_shards:
                    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


def shard_files(root: Path, array_names: list[str], shard_index: int) -> list[Path]:
    """The files that hold shard `shard_index` of each array (for fsync before journaling)."""
    found = []
    for name in array_names:
        first = root / name / "c" / str(shard_index)
        if first.is_file():
            found.append(first)
        elif first.is_dir():
            found.extend(p for p in first.rglob("*") if p.is_file())
    return found


def fsync_paths(paths: list[Path]) -> None:
    """Make written shard files and their directory entries durable."""
    dirs = set()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        dirs.add(path.parent)
    for directory in dirs:
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_attrs(group: zarr.Group, attrs: DatasetAttrs) -> None:
    group.attrs.update({ATTRS_KEY: attrs.to_json()})


def read_attrs(group: zarr.Group) -> DatasetAttrs:
    raw = group.attrs.get(ATTRS_KEY)
    if not isinstance(raw, dict):
        raise FormatError(f"{group.store} is a Zarr group but not a batchctl dataset (no {ATTRS_KEY!r} attributes).")
    return DatasetAttrs.from_json(raw)


def open_group(path: str | os.PathLike[str], allow_partial: bool = False) -> tuple[zarr.Group, DatasetAttrs]:
    """Open a dataset for reading; refuse one that is not marked complete unless asked to."""
    try:
        group = zarr.open_group(str(path), mode="r")
    except (FileNotFoundError, zarr.errors.GroupNotFoundError) as exc:
        raise FormatError(f"{path}: no batchctl dataset here ({exc.__class__.__name__}).") from exc
    attrs = read_attrs(group)
    if not attrs.complete and not allow_partial:
        raise IncompleteDatasetError(
            f"{path} is not marked complete (its build was interrupted or failed): rerun "
            "`batchctl build` to finish it, or pass allow_partial=True to read what is there."
        )
    return group, attrs
