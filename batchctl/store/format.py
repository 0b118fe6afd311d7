"""The dataset's arrays as the format lays them out (docs/format.md describes it): which fields
are compressed, how `source` strings are stored, making and opening the arrays, and writing or
removing whole shards. The attributes and their checks live in `batchctl.store.metadata`, the
documents in `batchctl.store.zarrmeta`, the shard codec in `batchctl.store.codec` and the chunk
readers in `batchctl.store.chunkread` (local) and `batchctl.store.remote` (URLs).

A dataset is a Zarr v3 group. Every array has one row per sample, is chunked by exactly
`batch_size` rows (one chunk = one batch) and sharded by `shard_batches` chunks. batchctl encodes
its chunks and shards itself (`ChunkEncoder`, byte for byte what zarr-python writes) and each shard
has one writer: zarr 3.1 rewrites a whole shard for any write into it and has no locking, so
partial writes from several processes would lose rows (zarr issues #3514, #3682).
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from batchctl.errors import FormatError, IncompleteDatasetError
from batchctl.store import metadata, ragged, storage
from batchctl.store.codec import (
    ChunkEncoder,
    shard_index_bytes,
)
from batchctl.store.metadata import (
    ATTRS_KEY,
    LABEL,
    SOURCE,
    SOURCE_INDEX,
    ZSTD_LEVEL,
    DatasetAttrs,
    FieldSpec,
    Layout,
    Schema,
    dimension_names,
    offsets_array,
    values_array,
)
from batchctl.store.zarrmeta import ArrayMeta, DatasetFiles

if TYPE_CHECKING:
    import zarr

# zarr-python is imported only where a dataset is read through it (`open_group`): a build writes
# its documents and shards itself, and a process that imports zarr pays ~0.2 s for it.

AUTO_KEEP = 0.5  # `auto` compresses a field whose sample chunk zstd shrinks to this fraction or less
AUTO_SAMPLE_BYTES = 8 * 2**20


def field_compressions(
    compression: str, schema: Schema, batch_size: int, rows: Mapping[str, np.ndarray]
) -> dict[str, str]:
    """The compression of each field. `auto` measures: zstd only where one chunk's worth of the
    first rows shrinks to half or less. Decoded photos shrink by 10-25% (the more greyscale
    pictures among them, the more) and float noise by ~10%: compressing them cost the build a
    tenth of its CPU and every epoch's reads two thirds of their speed, for a quarter of the disk
    at best; labels, masks, token ids and batchctl's own fields shrink many times. Without rows
    (nothing to measure) `auto` is zstd."""
    if compression != "auto":
        return {name: compression for name in schema}
    return {name: "zstd" if _zstd_pays(rows.get(name), batch_size) else "none" for name in schema}


def _zstd_pays(rows: np.ndarray | None, batch_size: int) -> bool:

    if rows is None or rows.nbytes == 0:
        return True
    row_bytes = max(1, rows[0].nbytes)
    sample = np.ascontiguousarray(rows[: max(1, min(batch_size, AUTO_SAMPLE_BYTES // row_bytes))])
    return _shrinks(sample.reshape(-1).view(np.uint8))


def _shrinks(raw: np.ndarray) -> bool:
    """Whether zstd (level ZSTD_LEVEL) shrinks these bytes to AUTO_KEEP of them or less."""
    import numcodecs

    return len(numcodecs.Zstd(level=ZSTD_LEVEL).encode(raw)) <= AUTO_KEEP * raw.nbytes


def compressors(compression: str) -> list[dict[str, Any]]:
    """A chunk's codecs after `bytes`. Every chunk carries a checksum: zstd's own frame checksum,
    or a crc32c codec after blosc or none."""
    if compression == "zstd":
        return [{"name": "zstd", "configuration": {"level": ZSTD_LEVEL, "checksum": True}}]
    crc32c = {"name": "crc32c"}
    if compression == "blosc":
        blosc = {"cname": "zstd", "clevel": ZSTD_LEVEL, "shuffle": "shuffle", "blocksize": 0}
        return [{"name": "blosc", "configuration": blosc}, crc32c]
    return [crc32c]


def encode_sources(sources: Sequence[str] | np.ndarray, width: int) -> np.ndarray:
    """Paths as rows of `width` UTF-8 bytes, zero-padded (no path holds a NUL byte)."""
    raw = [str(path).encode("utf-8") for path in sources]
    longest = max(map(len, raw), default=0)
    if longest > width:
        raise FormatError(f"a source path of {longest} bytes does not fit the dataset's {width}-byte source array")
    return np.array(raw, dtype=f"S{width}").view(np.uint8).reshape(len(raw), width)


def decode_sources(rows: np.ndarray) -> np.ndarray:
    """The `source` array's rows (zero-padded UTF-8 bytes) as strings."""
    rows = np.ascontiguousarray(rows, dtype=np.uint8)
    width = rows.shape[-1] if rows.ndim else 1
    return np.char.decode(rows.view(f"S{width}").reshape(rows.shape[:-1]), "utf-8")


def create_arrays(
    files: DatasetFiles,
    schema: Schema,
    layout: Layout,
    compression: str,
    labelled: bool,
    source_bytes: int,
    rows: Mapping[str, np.ndarray] | None = None,
) -> dict[str, ArrayMeta]:
    """Create every array empty (shape 0): the collator appends batches to shards
    (`batchctl.store.shards`) and sets the length last; the Dask engine sizes them first (`write_shard_at`).
    `source_bytes` is the `source` array's width; `rows`, the first rows of each field, are what
    `auto` compression measures. Only core Zarr v3 data types, so that every array opens in
    tensorstore, Rust zarrs and anything else that reads Zarr v3."""
    fixed = {name: spec for name, spec in schema.items() if not spec.ragged}
    compressions = field_compressions(compression, fixed, layout.batch_size, rows or {})
    columns: dict[str, tuple[tuple[int, ...], str]] = {name: (spec.shape, spec.dtype) for name, spec in fixed.items()}
    arrays = {}
    for name, spec in schema.items():
        if spec.ragged:
            first = (rows or {}).get(name)
            first_row = first[0] if first is not None and len(first) else np.empty((0, *spec.shape), spec.dtype)
            per_chunk = metadata.ragged_chunk_rows(spec, first_row, layout.batch_size)
            arrays.update(ragged_arrays(name, spec, layout, per_chunk, values_compression(compression, first_row)))
            columns[offsets_array(name)] = ((2,), "int64")  # batchctl's own: zstd under auto
    if labelled:
        columns[LABEL] = ((), "int64")
    columns[SOURCE] = ((source_bytes,), "uint8")
    columns[SOURCE_INDEX] = ((), "int64")
    for name, (row_shape, dtype) in columns.items():
        arrays[name] = ArrayMeta.sharded(
            name,
            row_shape,
            dtype,
            layout.batch_size,
            layout.shard_rows,
            compressors(compressions.get(name, "zstd" if compression == "auto" else compression)),
            ("sample", *dimension_names(name, len(row_shape))),
        )
    for meta in arrays.values():
        files.write_array(meta)
    return arrays


def values_compression(compression: str, first_row: np.ndarray) -> str:
    """A ragged field's values: `none` stays raw, `zstd` and `blosc` are zstd (each chunk a zstd
    frame), and `auto` is zstd where the first row (in dispatch order: the same whatever the
    workers) shrinks to half or less (token ids do; encoded images do not)."""
    if compression in ("none", "zstd"):
        return compression
    if compression == "blosc":
        return "zstd"
    raw = np.ascontiguousarray(first_row).reshape(-1).view(np.uint8)[:AUTO_SAMPLE_BYTES]
    return "zstd" if not raw.nbytes or _shrinks(raw) else "none"


def ragged_arrays(name: str, spec: FieldSpec, layout: Layout, per_chunk: int, compression: str) -> dict[str, ArrayMeta]:
    """A ragged field's two arrays (docs/format.md): `F.values`, a row per batch of RAGGED_CHUNKS
    chunks of `per_chunk` values, raw with a crc32c or zstd-compressed (`compression`); and
    `F.offsets`, made with the per-sample arrays."""
    values = values_array(name)
    capacity = per_chunk * metadata.RAGGED_CHUNKS
    meta = ArrayMeta.sharded(
        values,
        (capacity, *spec.shape),
        spec.dtype,
        1,
        layout.shard_batches,
        compressors(compression),
        ("batch", *dimension_names(values, len(spec.shape) + 1)),
        chunk_row_shape=(per_chunk, *spec.shape),
    )
    return {values: meta}


def open_dataset_arrays(group: zarr.Group, attrs: DatasetAttrs, where: str) -> dict[str, zarr.Array[Any]]:
    """The arrays of a dataset being read, each one the attributes promise (a field whose
    `zarr.json` is gone would silently vanish from every row), all of one length."""
    import zarr

    expected = [*metadata.array_names(attrs.schema), SOURCE_INDEX, SOURCE]
    expected += [LABEL] if attrs.classes is not None else []
    arrays = {}
    for name in expected if attrs.fields else []:
        try:
            node = group[name]
        except KeyError:
            raise FormatError(f"{where}: the array {name!r} is missing (no {name}/zarr.json)") from None
        except (ValueError, TypeError) as exc:
            raise FormatError(f"{where}: {name}/zarr.json is damaged ({_first_line(exc)})") from exc
        if not isinstance(node, zarr.Array):
            raise FormatError(f"{where}: {name!r} is not an array")
        arrays[name] = node
    lengths = {name: arr.shape[0] for name, arr in arrays.items()}
    want = {name: attrs.num_batches if metadata.stores_batches(name) else attrs.num_samples for name in arrays}
    if attrs.complete and any(n != want[name] for name, n in lengths.items()):
        odd = ", ".join(f"{name} {n}" for name, n in lengths.items() if n != want[name])
        raise FormatError(
            f"{where}: arrays disagree on the number of rows ({odd}; the dataset has {attrs.num_samples})"
        )
    return arrays


def check_batch_sizes(arrays: Mapping[str, zarr.Array[Any]], attrs: DatasetAttrs, where: str) -> None:
    """Every array is chunked by the dataset's batch size, and one batch of it fits in memory,
    before a reader allocates one: a damaged `zarr.json` can claim any shape."""
    limit = _memory_bytes() // 2
    for name, arr in arrays.items():
        rows = 1 if metadata.stores_batches(name) else attrs.batch_size
        if int(arr.chunks[0]) != rows:
            raise FormatError(
                f"{where}: {name} is chunked by {arr.chunks[0]} rows, not {rows} (the batch size {attrs.batch_size})"
            )
        nbytes = math.prod(int(n) for n in arr.chunks) * np.dtype(arr.dtype).itemsize
        if nbytes > limit:
            raise FormatError(
                f"{where}: one batch of {name} would take {nbytes / 2**30:.1f} GiB, more than half this "
                "machine's memory (its zarr.json is damaged, or the batches are too big to read here)"
            )


def _memory_bytes() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def stored_column(arr: ArrayMeta, name: str, column: Any) -> np.ndarray:
    """A column as its array stores it: `source` paths (strings) as their UTF-8 bytes."""
    if name == SOURCE and np.asarray(column).dtype.kind in "OUT":
        return encode_sources(column, int(arr.shape[1]))
    return np.asarray(column)


def _write_whole_shard(files: DatasetFiles, arr: ArrayMeta, layout: Layout, shard_index: int, data: np.ndarray) -> None:
    """Encode and store one whole shard ourselves (`ChunkEncoder`): zarr-python 3.1 reads the old
    shard back and assembles the new one in several copies, which cost more than compressing it."""
    encoder = ChunkEncoder.for_array(arr)
    pieces: list[Any] = []
    entries: list[tuple[int, int]] = []
    offset = 0
    for first in range(0, len(data), layout.batch_size):
        encoded = encoder.encode(data[first : first + layout.batch_size])
        nbytes = sum(len(piece) for piece in encoded)
        entries.append((offset, nbytes))
        pieces += encoded
        offset += nbytes
    files.write(arr.shard_key(shard_index), [*pieces, *shard_index_bytes(entries, layout.shard_batches)])


def write_shard_at(
    files: DatasetFiles,
    arrays: Mapping[str, ArrayMeta],
    layout: Layout,
    shard_index: int,
    columns: Mapping[str, np.ndarray],
) -> None:
    """Write shard `shard_index` whole into arrays already long enough to hold it: no metadata
    write, so several processes may each write their own shards at once (the Dask engine)."""
    start = shard_index * layout.shard_rows
    for name, arr in arrays.items():
        field_name, part = metadata.ragged_part(name)
        if part == metadata.VALUES_SUFFIX:
            offsets = arrays[offsets_array(field_name)]
            _write_ragged_shard(files, offsets, arr, layout, shard_index, columns[field_name])
        if part:
            continue  # (a ragged field's offsets are written with its values)
        data = stored_column(arr, name, columns[name])
        if start + len(data) > arr.shape[0]:
            raise FormatError(f"shard {shard_index}: {name} ends at row {arr.shape[0]}, before {start + len(data)}")
        _write_whole_shard(files, arr, layout, shard_index, data)


def _write_ragged_shard(
    files: DatasetFiles, offsets: ArrayMeta, values: ArrayMeta, layout: Layout, shard_index: int, rows: np.ndarray
) -> None:
    """One whole shard of a ragged field (an object array of its rows): its offsets' shard and its
    values' shard, batch by batch, as the collator writes them."""
    if shard_index * layout.shard_rows + len(rows) > offsets.shape[0]:
        raise FormatError(f"shard {shard_index}: {offsets.name} ends at row {offsets.shape[0]}")
    encoder = ragged.ValuesEncoder(values)
    spec = FieldSpec(tuple(values.shape[2:]), values.dtype, ragged=True)
    bounds: list[np.ndarray] = []
    pieces: list[Any] = []
    entries: list[tuple[int, int]] = []
    at = 0
    for first in range(0, len(rows), layout.batch_size):
        batch_offsets, batch_values = ragged.columns_of(rows[first : first + layout.batch_size], spec)
        bounds.append(batch_offsets)
        chunks = encoder.encode(batch_values)
        place = encoder.place(at, [sum(len(piece) for piece in chunk) for chunk in chunks])
        entries += ragged.index_entries(place, encoder)
        pieces += [piece for chunk in chunks for piece in chunk]
        at += place[1]
    index = shard_index_bytes(entries, layout.shard_batches * encoder.slots)
    files.write(values.shard_key(shard_index), [*pieces, *index])
    _write_whole_shard(files, offsets, layout, shard_index, np.concatenate(bounds) if bounds else np.empty((0, 2)))


def remove_shards_from(files: DatasetFiles, arrays: Collection[str], first: int) -> None:
    """Delete every shard file numbered `first` or more of the named `arrays` (resuming drops what
    the journal does not vouch for): what lies under `NAME/c/` (the default chunk key encoding)
    named by a number."""
    for name in arrays:
        folder = f"{name}/c"
        files.remove([f"{folder}/{n}" for n in files.listdir(folder) if n.isdigit() and int(n) >= first])


def read_attrs(group: zarr.Group) -> DatasetAttrs:
    raw = group.attrs.get(ATTRS_KEY)
    if not isinstance(raw, dict):
        raise FormatError(f"{group.store} is a Zarr group but not a batchctl dataset (no {ATTRS_KEY!r} attributes).")
    return DatasetAttrs.from_json(raw)


def open_group(
    path: str | os.PathLike[str], allow_partial: bool = False, storage_options: Mapping[str, Any] | None = None
) -> tuple[zarr.Group, DatasetAttrs]:
    """Open a dataset (a local path or a URL) for reading; refuse one that is not marked
    complete unless asked to."""
    import zarr

    location = os.fspath(path)
    try:
        # each array's own zarr.json, not the group's consolidated copy of them: what batchctl
        # checks (and `verify` compares the copy with) is what every reader finds there
        options = storage.zarr_options(location, storage_options)
        group = zarr.open_group(location, mode="r", use_consolidated=False, **options)
    except (FileNotFoundError, zarr.errors.GroupNotFoundError) as exc:
        raise FormatError(f"{path}: no batchctl dataset here (no zarr.json; `batchctl build` makes one).") from exc
    except (ValueError, TypeError, KeyError) as exc:  # a zarr.json that is not JSON, or not Zarr's
        raise FormatError(f"{path}: its zarr.json is damaged ({_first_line(exc)}).") from exc
    attrs = read_attrs(group)
    if not attrs.complete and not allow_partial:
        raise IncompleteDatasetError(
            f"{path} is not marked complete (its build was interrupted or failed): rerun "
            "`batchctl build` to finish it, or pass allow_partial=True to read what is there."
        )
    return group, attrs
