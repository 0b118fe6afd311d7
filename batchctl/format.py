"""The on-disk format, enforced here and nowhere else (docs/format.md describes it).

A dataset is a Zarr v3 group. Every array has one row per sample, is chunked by exactly
`batch_size` rows (one chunk = one batch) and sharded by `shard_batches` chunks. batchctl encodes
its chunks and shards itself (`ChunkEncoder`, byte for byte what zarr-python writes) and each shard
has one writer: zarr 3.1 rewrites a whole shard for any write into it and has no locking, so
partial writes from several processes would lose rows (zarr issues #3514, #3682).
"""

from __future__ import annotations

import io
import json
import mmap
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import google_crc32c
import numcodecs
import numpy as np
import zarr
import zarr.codecs as zc
import zarr.storage
from zarr.core.array_spec import ArrayConfigParams
from zarr.core.buffer import cpu
from zarr.core.sync import sync

from batchctl import storage
from batchctl.errors import DatasetReplacedError, FormatError, IncompleteDatasetError
from batchctl.metadata import (
    ATTRS_KEY as ATTRS_KEY,
)
from batchctl.metadata import (
    COMPRESSIONS as COMPRESSIONS,
)
from batchctl.metadata import (
    DEFAULT_SHARD_BYTES as DEFAULT_SHARD_BYTES,
)
from batchctl.metadata import (  # the metadata, re-exported: `format` is the one place the format lives
    FORMAT_VERSION as FORMAT_VERSION,
)
from batchctl.metadata import (
    LABEL as LABEL,
)
from batchctl.metadata import (
    MAX_SHARD_BATCHES as MAX_SHARD_BATCHES,
)
from batchctl.metadata import (
    MAX_SKIPPED_LISTED as MAX_SKIPPED_LISTED,
)
from batchctl.metadata import (
    MIN_SHARD_BATCHES as MIN_SHARD_BATCHES,
)
from batchctl.metadata import (
    RESERVED_FIELDS as RESERVED_FIELDS,
)
from batchctl.metadata import (
    SOURCE as SOURCE,
)
from batchctl.metadata import (
    SOURCE_INDEX as SOURCE_INDEX,
)
from batchctl.metadata import (
    SOURCE_WIDTH_STEP as SOURCE_WIDTH_STEP,
)
from batchctl.metadata import (
    ZSTD_LEVEL as ZSTD_LEVEL,
)
from batchctl.metadata import (
    DatasetAttrs as DatasetAttrs,
)
from batchctl.metadata import (
    FieldSpec as FieldSpec,
)
from batchctl.metadata import (
    Layout as Layout,
)
from batchctl.metadata import (
    Schema as Schema,
)
from batchctl.metadata import (
    default_shard_batches as default_shard_batches,
)
from batchctl.metadata import (
    num_batches as num_batches,
)
from batchctl.metadata import (
    parse_compression as parse_compression,
)
from batchctl.metadata import (
    source_width as source_width,
)

WRITE_CONFIG: ArrayConfigParams = {"write_empty_chunks": True}  # every shard is a file, even an all-zero one


AUTO_KEEP = 0.8  # `auto` compresses a field whose sample chunk zstd shrinks below this fraction
AUTO_SAMPLE_BYTES = 8 * 2**20


def field_compressions(
    compression: str, schema: Schema, batch_size: int, rows: Mapping[str, np.ndarray]
) -> dict[str, str]:
    """The compression of each field. `auto` measures: zstd only where one chunk's worth of the
    first rows shrinks by more than a fifth. Decoded photos and float noise shrink by ~10%, so
    compressing them costs the build a third of a core and every epoch's reads up to half their
    speed for a tenth of the disk; labels, masks, token ids and batchctl's own fields shrink many
    times. Without rows (nothing to measure) `auto` is zstd."""
    if compression != "auto":
        return {name: compression for name in schema}
    return {name: "zstd" if _zstd_pays(rows.get(name), batch_size) else "none" for name in schema}


def _zstd_pays(rows: np.ndarray | None, batch_size: int) -> bool:
    if rows is None or rows.nbytes == 0:
        return True
    row_bytes = max(1, rows[0].nbytes)
    sample = np.ascontiguousarray(rows[: max(1, min(batch_size, AUTO_SAMPLE_BYTES // row_bytes))])
    raw = sample.reshape(-1).view(np.uint8)
    return len(numcodecs.Zstd(level=ZSTD_LEVEL).encode(raw)) < AUTO_KEEP * raw.nbytes


def _compressors(compression: str) -> list[Any]:
    """Every chunk carries a checksum: zstd's own frame checksum, or a crc32c codec after blosc/none."""
    if compression == "zstd":
        return [zc.ZstdCodec(level=ZSTD_LEVEL, checksum=True)]
    if compression == "blosc":
        return [zc.BloscCodec(cname="zstd", clevel=ZSTD_LEVEL, shuffle="shuffle"), zc.Crc32cCodec()]
    return [zc.Crc32cCodec()]


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
    group: zarr.Group,
    schema: Schema,
    layout: Layout,
    compression: str,
    labelled: bool,
    source_bytes: int,
    rows: Mapping[str, np.ndarray] | None = None,
) -> dict[str, zarr.Array[Any]]:
    """Create every array empty (shape 0): the collator appends batches to shards
    (`batchctl.shards`) and sets the length last; the Dask engine sizes them first (`write_shard_at`).
    `source_bytes` is the `source` array's width; `rows`, the first rows of each field, are what
    `auto` compression measures. Only core Zarr v3 data types, so that every array opens in
    tensorstore, Rust zarrs and anything else that reads Zarr v3."""
    compressions = field_compressions(compression, schema, layout.batch_size, rows or {})
    columns: dict[str, tuple[tuple[int, ...], Any]] = {name: (spec.shape, spec.dtype) for name, spec in schema.items()}
    if labelled:
        columns[LABEL] = ((), "int64")
    columns[SOURCE] = ((source_bytes,), "uint8")
    columns[SOURCE_INDEX] = ((), "int64")
    arrays = {}
    for name, (row_shape, dtype) in columns.items():
        arrays[name] = group.create_array(
            name,
            shape=(0, *row_shape),
            dtype=dtype,
            chunks=(layout.batch_size, *row_shape),
            shards=(layout.shard_rows, *row_shape),
            compressors=_compressors(compressions.get(name, "zstd" if compression == "auto" else compression)),
            dimension_names=("sample", *dimension_names(name, len(row_shape))),
            config=WRITE_CONFIG,
        )
    return arrays


def dimension_names(name: str, ndim: int) -> list[str]:
    """Each field's own names for its row dimensions (xarray needs names of one size throughout)."""
    if name == SOURCE:
        return ["source_byte"]
    return [f"{name}_dim{i}" for i in range(ndim)]


def open_arrays(group: zarr.Group) -> dict[str, zarr.Array[Any]]:
    # the config is not stored with the array: give it again to every array that may be written
    return {name: arr.with_config(WRITE_CONFIG) for name, arr in group.arrays()}


def open_dataset_arrays(group: zarr.Group, attrs: DatasetAttrs, where: str) -> dict[str, zarr.Array[Any]]:
    """The arrays of a dataset being read, each one the attributes promise (a field whose
    `zarr.json` is gone would silently vanish from every row), all of one length."""
    expected = [*attrs.fields, SOURCE_INDEX, SOURCE] + ([LABEL] if attrs.classes is not None else [])
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
    if attrs.complete and any(n != attrs.num_samples for n in lengths.values()):
        odd = ", ".join(f"{name} {n}" for name, n in lengths.items() if n != attrs.num_samples)
        raise FormatError(
            f"{where}: arrays disagree on the number of rows ({odd}; the dataset has {attrs.num_samples})"
        )
    return arrays


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def stored_column(arr: zarr.Array[Any], name: str, column: Any) -> np.ndarray:
    """A column as its array stores it: `source` paths (strings) as their UTF-8 bytes."""
    if name == SOURCE and np.asarray(column).dtype.kind in "OUT":
        return encode_sources(column, int(arr.shape[1]))
    return np.asarray(column)


def _write_whole_shard(arr: zarr.Array[Any], layout: Layout, shard_index: int, data: np.ndarray) -> None:
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
    store_object(arr, shard_key(arr, shard_index), [*pieces, *shard_index_bytes(entries, layout.shard_batches)])


def store_object(arr: zarr.Array[Any], key: str, pieces: list[Any]) -> None:
    """Write one whole object of an array: a local file atomically, an object store by one PUT."""
    if isinstance(arr.store, zarr.storage.LocalStore):
        _write_atomically(Path(arr.store.root) / key, pieces)
    else:  # an object store's PUT is atomic
        sync(arr.store.set(key, cpu.Buffer.from_bytes(b"".join(pieces))))


def _write_atomically(path: Path, pieces: list[Any]) -> None:
    """As zarr's LocalStore does it (a temporary file renamed over the shard, so readers never see
    a torn one), but written from the pieces without joining them into one more copy."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        with tmp.open("wb") as file:
            file.writelines(pieces)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class ChunkEncoder:
    """Encodes one chunk (one batch) of an array exactly as zarr-python would inside a
    `sharding_indexed` shard (tests/test_transport.py compares the bytes): zstd with its frame
    checksum, or blosc then crc32c, or the raw little-endian bytes then crc32c. A short last
    batch is padded with the fill value, as zarr does. zstd, blosc and crc32c release the GIL."""

    def __init__(self, arr: zarr.Array[Any], inner: list[dict[str, Any]]) -> None:
        self.chunk_shape = tuple(int(n) for n in arr.chunks)
        self.dtype = np.dtype(arr.dtype)
        self.fill = arr.fill_value
        names = [codec["name"] for codec in inner]
        config = inner[1].get("configuration") or {}
        self.compressor: Any = None
        if names[1] == "zstd":
            self.compressor = numcodecs.Zstd(level=config.get("level", 0), checksum=config.get("checksum", False))
        elif names[1] == "blosc":
            shuffle = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}[config.get("shuffle", "noshuffle")]
            self.compressor = numcodecs.Blosc.from_config(  # as zarr's BloscCodec configures it
                {
                    "cname": config.get("cname", "zstd"),
                    "clevel": config.get("clevel", 5),
                    "shuffle": shuffle,
                    "blocksize": config.get("blocksize", 0),
                    "typesize": int(config.get("typesize") or 1),
                }
            )
        self.crc = names[-1] == "crc32c"

    @classmethod
    def for_array(cls, arr: zarr.Array[Any]) -> ChunkEncoder:
        inner = own_codecs(arr)
        if inner is None:
            raise FormatError(f"{arr.path}: not a layout batchctl writes (docs/format.md)")
        return cls(arr, inner)

    def encode(self, rows: np.ndarray) -> list[Any]:
        """The stored pieces of one chunk holding `rows` (at most one chunk of them)."""
        if len(rows) < self.chunk_shape[0]:
            padded = np.full(self.chunk_shape, self.fill, dtype=self.dtype)
            padded[: len(rows)] = rows
            rows = padded
        raw = np.ascontiguousarray(rows, dtype=self.dtype.newbyteorder("<")).reshape(-1).view(np.uint8)
        if self.compressor is None:
            return [raw, _crc32c_bytes(raw)]
        encoded = self.compressor.encode(raw)
        return [encoded, _crc32c_bytes(encoded)] if self.crc else [encoded]

    def decode(self, data: bytes) -> np.ndarray:
        """One stored chunk back to its rows (for resuming a half-filled batch)."""
        if self.crc:
            data, stored = data[:-4], data[-4:]
            if google_crc32c.value(bytes(data)) != int.from_bytes(stored, "little"):
                raise FormatError("the chunk checksum does not match")
        raw = self.compressor.decode(data) if self.compressor is not None else data
        return np.frombuffer(raw, dtype=self.dtype.newbyteorder("<")).reshape(self.chunk_shape).copy()


def shard_index_bytes(entries: list[tuple[int, int]], shard_batches: int) -> list[Any]:
    """The index that ends a shard: (offset, nbytes) of each chunk, little-endian uint64, an empty
    position marked as all ones, then its crc32c."""
    index = np.full((shard_batches, 2), _NO_CHUNK, dtype="<u8")
    for position, entry in enumerate(entries):
        index[position] = entry
    index_bytes = index.reshape(-1).view(np.uint8)
    return [index_bytes, _crc32c_bytes(index_bytes)]


def read_shard_index(path: Path, shard_batches: int) -> list[list[int]]:
    """The (offset, nbytes) of each chunk of a local shard file, from its index (checked)."""
    nbytes = shard_batches * 16 + 4
    with open(path, "rb") as file:
        file.seek(-nbytes, os.SEEK_END)
        raw = file.read(nbytes)
    if len(raw) != nbytes or google_crc32c.value(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
        raise FormatError(f"{path}: the shard index checksum does not match")
    return [[int(offset), int(size)] for offset, size in np.frombuffer(raw[:-4], dtype="<u8").reshape(-1, 2)]


def _crc32c_bytes(data: Any) -> bytes:
    return int(google_crc32c.value(data)).to_bytes(4, "little")


def write_shard_at(
    arrays: Mapping[str, zarr.Array[Any]], layout: Layout, shard_index: int, columns: Mapping[str, np.ndarray]
) -> None:
    """Write shard `shard_index` whole into arrays already long enough to hold it: no metadata
    write, so several processes may each write their own shards at once (the Dask engine)."""
    start = shard_index * layout.shard_rows
    for name, arr in arrays.items():
        data = stored_column(arr, name, columns[name])
        if start + len(data) > arr.shape[0]:
            raise FormatError(f"shard {shard_index}: {name} ends at row {arr.shape[0]}, before {start + len(data)}")
        _write_whole_shard(arr, layout, shard_index, data)


def remove_shards_from(arrays: Mapping[str, zarr.Array[Any]], fs: Any, root: str, first: int) -> None:
    """Delete every shard file numbered `first` or more (resuming drops what the journal does not
    vouch for). `fs` is the fsspec filesystem holding the dataset at `root`."""
    for name in arrays:
        shard_dir = f"{root}/{name}/c"
        if fs.isdir(shard_dir):
            names = [(p, p.rsplit("/", 1)[-1]) for p in fs.ls(shard_dir, detail=False)]
            stale = [p for p, n in names if n.isdigit() and int(n) >= first]
            if stale:
                fs.rm(stale, recursive=True)


def shard_keys(arrays: Mapping[str, zarr.Array[Any]], shard_index: int) -> list[str]:
    """The keys, relative to the dataset root, of the objects holding shard `shard_index` of each
    array (for fsync before journaling, and for verify)."""
    return [f"{arr.path}/{_shard_key(arr, shard_index)}" for arr in arrays.values()]


def shard_key(arr: zarr.Array[Any], shard_index: int) -> str:
    """The key of shard `shard_index` of `arr`, relative to the dataset root."""
    return f"{arr.path}/{_shard_key(arr, shard_index)}"


def _shard_key(arr: zarr.Array[Any], shard_index: int) -> str:
    return str(arr.metadata.encode_chunk_key((shard_index,) + (0,) * (arr.ndim - 1)))


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


def open_group(
    path: str | os.PathLike[str], allow_partial: bool = False, storage_options: Mapping[str, Any] | None = None
) -> tuple[zarr.Group, DatasetAttrs]:
    """Open a dataset (a local path or a URL) for reading; refuse one that is not marked
    complete unless asked to."""
    location = os.fspath(path)
    try:
        group = zarr.open_group(location, mode="r", **storage.zarr_options(location, storage_options))
    except (FileNotFoundError, zarr.errors.GroupNotFoundError) as exc:
        raise FormatError(f"{path}: no batchctl dataset here ({exc.__class__.__name__}).") from exc
    except (ValueError, TypeError, KeyError) as exc:  # a zarr.json that is not JSON, or not Zarr's
        raise FormatError(f"{path}: its zarr.json is damaged ({_first_line(exc)}).") from exc
    attrs = read_attrs(group)
    if not attrs.complete and not allow_partial:
        raise IncompleteDatasetError(
            f"{path} is not marked complete (its build was interrupted or failed): rerun "
            "`batchctl build` to finish it, or pass allow_partial=True to read what is there."
        )
    return group, attrs


_INNER_CODECS = (["bytes", "zstd"], ["bytes", "blosc", "crc32c"], ["bytes", "crc32c"])


def own_codecs(arr: zarr.Array[Any]) -> list[dict[str, Any]] | None:
    """The inner codecs of `arr` when its layout is the one batchctl writes and decodes itself
    (`ChunkReader`, `ChunkEncoder`), else None:
    `sharding_indexed` with the index at the end (little-endian uint64 offset/nbytes pairs plus
    crc32c), one chunk across all but the first dimension, inner codecs bytes + zstd,
    bytes + blosc + crc32c, or bytes + crc32c, little-endian numbers."""
    if arr.dtype.kind not in "biuf" or not arr.shards:
        return None
    (codec,) = arr.metadata.codecs  # type: ignore[union-attr]
    sharding: dict[str, Any] = json.loads(json.dumps(codec.to_dict()))
    config: dict[str, Any] = sharding.get("configuration") or {}
    inner = list(config.get("codecs", ()))
    names = [codec["name"] for codec in inner]
    index_names = [codec["name"] for codec in config.get("index_codecs", ())]
    endian = (inner[0].get("configuration") or {}).get("endian", "little") if inner else None
    little = np.dtype(arr.dtype).byteorder in "<|=" and endian == "little"
    if (
        sharding.get("name") != "sharding_indexed"
        or config.get("index_location") != "end"
        or index_names != ["bytes", "crc32c"]
        or names not in _INNER_CODECS
        or not little
        or any(int(s) != int(c) for s, c in zip(arr.shards[1:], arr.chunks[1:], strict=True))
    ):
        return None
    return inner


_NO_CHUNK = 2**64 - 1  # an index entry of an empty chunk in the sharding_indexed codec
_SHARD_CACHE = 4


class RowReader:
    """Rows `start:stop` of the arrays of a dataset (an incremental build's carried rows): read
    chunk by chunk straight from a local dataset's shard files (`ChunkReader`, several times
    zarr-python's speed), through zarr otherwise."""

    def __init__(self, location: str, arrays: Mapping[str, zarr.Array[Any]]) -> None:
        self.arrays = arrays
        self.root = None if storage.is_url(location) else DatasetRoot(Path(location))
        self.readers = {
            name: ChunkReader.for_array(self.root, arr) if self.root else None for name, arr in arrays.items()
        }

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        reader, arr = self.readers[name], self.arrays[name]
        if reader is None:
            return np.asarray(arr[start:stop])
        size = reader.chunk_shape[0]
        chunks = [reader.read(chunk) for chunk in range(start // size, (stop - 1) // size + 1)]
        first = (start // size) * size
        return np.concatenate(chunks)[start - first : stop - first]

    def close(self) -> None:
        if self.root is not None:
            self.root.close()


class DatasetRoot:
    """A local dataset's folder, held open from the moment the dataset is opened: its files are
    opened relative to it, so a reader keeps reading the version it opened even after a rebuild
    swapped a new one into the path, and says so once that old version is gone."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise FormatError(f"{path}: cannot open the dataset's folder ({exc.strerror})") from None

    def open(self, key: str, what: str) -> io.FileIO:
        """The file `key` of the opened version; a missing one is damage, or the version is gone."""
        try:
            fd = os.open(key, os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.fd)
        except FileNotFoundError:
            self.check_current()
            raise FormatError(f"{self.path}: {what} is missing (no file {key}); `batchctl verify` lists all") from None
        return io.FileIO(fd, "r", closefd=True)

    def check_current(self) -> None:
        """Raise `DatasetReplacedError` when the opened version is no longer the one at the path."""
        opened = os.fstat(self.fd)
        try:
            now = os.stat(self.path)
        except FileNotFoundError:
            now = None
        if opened.st_nlink == 0 or now is None or (now.st_dev, now.st_ino) != (opened.st_dev, opened.st_ino):
            raise DatasetReplacedError(
                f"{self.path} was replaced or removed by another build after it was opened; open it again"
            )

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ChunkReader:
    """Reads one whole chunk (= one batch) of a numeric array straight from its shard file.

    zarr-python 3.1 reads a 9.6 MB batch of images at ~0.8 GB/s while zstd alone decodes it at
    ~4 GB/s (benchmarks/read.py), so the reader decodes chunks of the layout written here itself,
    compressed chunks straight from a memory mapping, uncompressed ones with one pread into the
    result (a mapping's page faults halved that rate):
    `sharding_indexed` with the index at the end (little-endian uint64 offset/nbytes pairs plus
    crc32c), inner codecs bytes + zstd, bytes + blosc + crc32c, or bytes + crc32c. Every checksum
    is checked. `for_array` returns None for any other layout, and the caller then uses zarr.
    """

    def __init__(self, root: DatasetRoot, arr: zarr.Array[Any], inner: list[dict[str, Any]]) -> None:
        self.root = root
        self.arr = arr
        self.chunk_shape = tuple(int(n) for n in arr.chunks)
        self.per_shard = int(arr.shards[0]) // self.chunk_shape[0]  # type: ignore[index]
        self.dtype = np.dtype(arr.dtype)
        self.inner = [codec["name"] for codec in inner]
        self._shards: dict[int, tuple[io.FileIO, mmap.mmap, np.ndarray]] = {}
        self._lock = threading.Lock()

    @classmethod
    def for_array(cls, root: DatasetRoot, arr: zarr.Array[Any]) -> ChunkReader | None:
        inner = own_codecs(arr)
        return None if inner is None else cls(root, arr, inner)

    def _shard(self, shard: int) -> tuple[io.FileIO, mmap.mmap, np.ndarray]:
        """An open shard file, its mapping and its index; the last few are kept."""
        with self._lock:  # prefetch threads share the cache
            cached = self._shards.get(shard)
            if cached is None:
                cached = self._open(shard)
                if len(self._shards) >= _SHARD_CACHE:
                    self._shards.pop(next(iter(self._shards)))  # closed once no read holds it
                self._shards[shard] = cached
        return cached

    def _open(self, shard: int) -> tuple[io.FileIO, mmap.mmap, np.ndarray]:
        """The shard file, opened and mapped, and its index, checked against its crc32c."""
        key = self.arr.metadata.encode_chunk_key((shard,) + (0,) * (len(self.chunk_shape) - 1))
        file = self.root.open(f"{self.arr.path}/{key}", f"{self.arr.path} shard {shard}")
        nbytes = self.per_shard * 16 + 4
        size = os.fstat(file.fileno()).st_size
        raw = os.pread(file.fileno(), nbytes, size - nbytes) if size >= nbytes else b""
        if len(raw) != nbytes or google_crc32c.value(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
            raise FormatError(f"shard {shard}: the shard index checksum does not match")
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        return file, mapped, np.frombuffer(raw[:-4], dtype="<u8").reshape(self.per_shard, 2)

    def read(self, chunk: int) -> np.ndarray:
        """Chunk `chunk` as an array of the full chunk shape (rows past the end are fill)."""
        try:
            return self._read(chunk)
        except FormatError:
            raise
        except (RuntimeError, ValueError) as exc:  # what the decoders raise on bad bytes
            raise FormatError(
                f"{self.arr.path} batch {chunk}: corrupt data ({exc}); `batchctl verify` lists all"
            ) from exc

    def _read(self, chunk: int) -> np.ndarray:
        shard, position = divmod(chunk, self.per_shard)
        file, mapped, index = self._shard(shard)
        offset, nbytes = (int(v) for v in index[position])
        if offset == _NO_CHUNK:  # zarr would read fill values; in a batchctl dataset it is damage
            raise FormatError(f"{self.arr.path} shard {shard}: batch {chunk} is missing from the shard")
        out = np.empty(self.chunk_shape, self.dtype)  # decoded (or read) straight into a writable array
        raw_out = out.reshape(-1).view(np.uint8)
        if self.inner == ["bytes", "crc32c"] and nbytes == raw_out.nbytes + 4:
            # uncompressed: one read into the result, as np.load does; no mapping, no extra copy
            stored = bytearray(4)
            if os.preadv(file.fileno(), [raw_out.data, stored], offset) != nbytes:
                raise FormatError(f"shard {shard}, chunk {position}: the shard file is truncated")
            if google_crc32c.value(raw_out) != int.from_bytes(stored, "little"):
                raise FormatError(f"shard {shard}, chunk {position}: the chunk checksum does not match")
            return out
        # compressed chunks are decoded straight from the mapping (measured faster than pread here)
        data = memoryview(mapped)[offset : offset + nbytes]
        if self.inner[-1] == "crc32c":
            data, stored_crc = data[:-4], data[-4:]
            if google_crc32c.value(bytes(data)) != int.from_bytes(stored_crc, "little"):
                raise FormatError(f"shard {shard}, chunk {position}: the chunk checksum does not match")
        if "zstd" in self.inner:
            numcodecs.Zstd().decode(data, out=out)  # libzstd checks the frame checksum
        elif "blosc" in self.inner:
            numcodecs.Blosc().decode(data, out=out)
        else:
            raw_out[:] = np.frombuffer(data, np.uint8)
        return out
