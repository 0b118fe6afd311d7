"""Reading a local dataset's chunks straight from its shard files, held by an open folder so
that a reader keeps the version it opened (the reader and an incremental build's carry use it)."""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np

from batchctl.errors import DatasetReplacedError, FormatError
from batchctl.store import ragged
from batchctl.store.codec import NO_CHUNK, own_codecs, parse_shard_index
from batchctl.store.crc import crc32c
from batchctl.store.zarrmeta import ArrayMeta

_SHARD_CACHE = 4
_IOV_MAX = 1000  # buffers per preadv: Linux takes at most 1024


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
        try:
            refuse_special_files(path)
        except BaseException:
            self.close()
            raise

    def open(self, key: str, what: str) -> io.FileIO:
        """The file `key` of the opened version; a missing one is damage, or the version is gone.
        Opened without blocking and refused unless a regular file: a FIFO would wait for ever."""
        try:
            fd = os.open(key, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=self.fd)
        except FileNotFoundError:
            self.check_current()
            raise FormatError(f"{self.path}: {what} is missing (no file {key}); `batchctl verify` lists all") from None
        except OSError as exc:
            raise FormatError(f"{self.path}: {what} cannot be opened ({exc.strerror})") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise FormatError(f"{self.path}: {what} ({key}) is not a regular file")
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


def refuse_special_files(root: Path) -> None:
    """Every entry under a local dataset is a folder or a regular file (links followed), before
    anything in it is opened: a FIFO in place of a `zarr.json` or a shard would block any reader
    (zarr-python's included) for ever, and a device could be read without end."""
    pending = [root]
    while pending:
        folder = pending.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError as exc:
            raise FormatError(f"{folder}: cannot list the dataset's folder ({exc.strerror})") from None
        for entry in entries:
            try:
                mode = entry.stat().st_mode  # follows links: what a reader would open
            except FileNotFoundError:
                continue  # a dangling link reads as a missing file, which the readers report
            if stat.S_ISDIR(mode):
                if not entry.is_symlink():
                    pending.append(Path(entry.path))
            elif not stat.S_ISREG(mode):
                raise FormatError(f"{entry.path} is not a regular file (a FIFO, socket or device): not a dataset's")


class ChunkLayout:
    """One array's chunks as batchctl writes them, whatever holds their bytes (`ChunkReader`: a
    local shard file; `remote.RemoteChunkReader`: ranged reads at a URL): the layout, a shard's
    index parsed and a chunk found in it, and a chunk's bytes checked and decoded into the rows a
    caller hands. `sharding_indexed` with the index at the end (little-endian uint64 offset/nbytes
    pairs plus crc32c), inner codecs bytes + zstd, bytes + blosc + crc32c, or bytes + crc32c;
    every checksum is checked, and a missing shard or chunk is damage, not fill values."""

    def __init__(self, arr: ArrayMeta, inner: list[dict[str, Any]]) -> None:
        self.arr = arr
        self.chunk_shape = tuple(int(n) for n in arr.chunks)
        self.per_shard = arr.grid[0] // self.chunk_shape[0]
        self.dtype = np.dtype(arr.dtype)
        self.chunk_bytes = self.dtype.itemsize * int(np.prod(self.chunk_shape))
        self.index_bytes = self.per_shard * 16 + 4
        self.inner = [codec["name"] for codec in inner]

    def where(self, chunk: int) -> str:
        return f"{self.arr.name} shard {chunk // self.per_shard}, batch {chunk}"

    def parse_index(self, raw: bytes, shard: int) -> np.ndarray:
        return parse_shard_index(raw, self.per_shard, f"{self.arr.name} shard {shard}")

    def locate(self, index: np.ndarray, chunk: int) -> tuple[int, int]:
        """Chunk `chunk`'s offset and size in its shard, from the shard's index."""
        offset, nbytes = (int(v) for v in index[chunk % self.per_shard])
        if offset == NO_CHUNK:  # zarr would read fill values; in a batchctl dataset it is damage
            raise FormatError(
                f"{self.arr.name} shard {chunk // self.per_shard}: batch {chunk} is missing from the shard"
            )
        return offset, nbytes

    def stored_raw(self, nbytes: int) -> bool:
        """Whether a chunk of `nbytes` stored bytes is its rows as they are, then a crc32c: then a
        byte source may read it straight into the rows (and `check_raw` them)."""
        return self.inner == ["bytes", "crc32c"] and nbytes == self.chunk_bytes + 4

    def check_raw(self, rows: list[np.ndarray], stored_crc: bytes, chunk: int) -> None:
        crc = 0
        for row in rows:
            crc = crc32c(row, crc)
        if crc != int.from_bytes(stored_crc, "little"):
            raise FormatError(f"{self.where(chunk)}: the chunk checksum does not match")

    def decode_into(
        self, chunk: int, data: memoryview, rows: list[np.ndarray], scratch: np.ndarray | None = None
    ) -> None:
        """Chunk `chunk`'s stored bytes `data` into `rows` (flat, laid end to end: `row_views`),
        through `scratch` (a chunk's bytes) when there are several."""
        whole = rows[0] if len(rows) == 1 else np.empty(self.chunk_bytes, np.uint8) if scratch is None else scratch
        with corrupt_data_named(self.arr.name, chunk):
            decode_chunk(self.inner, data, whole, self.where(chunk))
        if len(rows) > 1:
            spread(whole, rows)


class ChunkReader(ChunkLayout):
    """Reads one whole chunk (= one batch) of a numeric array straight from its local shard file.

    zarr-python 3.1 reads a 9.6 MB batch of images at ~0.8 GB/s while zstd alone decodes it at
    ~4 GB/s (benchmarks/read.py), so the reader decodes chunks of the layout written here itself,
    compressed chunks straight from a memory mapping, uncompressed ones with one preadv into the
    rows (a mapping's page faults halved that rate). `for_array` returns None for any other
    layout, and the caller then uses zarr.
    """

    def __init__(self, root: DatasetRoot, arr: ArrayMeta, inner: list[dict[str, Any]]) -> None:
        super().__init__(arr, inner)
        self.root = root
        self._shards = ShardFiles(root, arr, self.per_shard)
        self._local = threading.local()

    @classmethod
    def for_array(cls, root: DatasetRoot, arr: ArrayMeta) -> ChunkReader | None:
        inner = own_codecs(arr)
        return None if inner is None else cls(root, arr, inner)

    def read(self, chunk: int) -> np.ndarray:
        """Chunk `chunk` as an array of the full chunk shape (rows past the end are fill)."""
        out = np.empty(self.chunk_shape, self.dtype)  # decoded (or read) straight into a writable array
        self.read_rows(chunk, [out.reshape(-1).view(np.uint8)])
        return out

    def read_rows(self, chunk: int, rows: list[np.ndarray]) -> None:
        """Chunk `chunk` into `rows`: C-contiguous buffers laid end to end, together one chunk's
        bytes (one buffer for the whole chunk, or one per row: the loader hands each row's place
        in the batch it will go to, so a shuffle costs no copy). Uncompressed chunks are read from
        the file straight into them; compressed ones decoded, then copied. Checksums are checked."""
        views = row_views(rows, self.chunk_bytes)
        held = self._shards.get(chunk // self.per_shard)  # kept while this read uses it: closed with the last holder
        offset, nbytes = self.locate(held.index, chunk)
        if self.stored_raw(nbytes):
            self._read_raw(held.file, offset, views, chunk)
        else:  # compressed chunks are decoded straight from the mapping (measured faster than pread here)
            self.decode_into(chunk, memoryview(held.mapped)[offset : offset + nbytes], views, self._scratch())

    def _read_raw(self, file: io.FileIO, offset: int, rows: list[np.ndarray], chunk: int) -> None:
        """An uncompressed chunk read into the buffers by the kernel, as np.load does (no mapping, no copy)."""
        stored = bytearray(4)
        buffers = [*(row.data for row in rows), memoryview(stored)]
        at = offset
        for start in range(0, len(buffers), _IOV_MAX):
            part = buffers[start : start + _IOV_MAX]
            want = sum(b.nbytes for b in part)
            if os.preadv(file.fileno(), part, at) != want:
                raise FormatError(f"{self.where(chunk)}: the shard file is truncated")
            at += want
        self.check_raw(rows, bytes(stored), chunk)

    def _scratch(self) -> np.ndarray:
        """This thread's buffer for a decoded chunk whose rows go elsewhere (reused: warm pages)."""
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = np.empty(self.chunk_bytes, np.uint8)
        return cast(np.ndarray, scratch)


class ValuesLayout:
    """A ragged field's values (`F.values`, docs/format.md) as batchctl writes them, whatever holds
    their bytes (`ValuesReader`: a local shard file; `remote.RemoteValuesReader`: ranged reads at
    a URL): a batch's chunks lie one after another, so one read takes them all; where they lie
    is found in the shard's index, and each chunk's checksum is checked as they are decoded."""

    holder = "file"  # what holds a shard, for messages

    def __init__(self, arr: ArrayMeta) -> None:
        self.arr = arr
        self.encoder = ragged.ValuesEncoder(arr)
        self.per_shard = int(arr.grid[0])  # batches
        self.positions = arr.chunks_per_shard  # index entries of a shard

    def where(self, batch: int) -> str:
        return f"{self.arr.name} shard {batch // self.per_shard}, batch {batch}"

    def place(self, index: np.ndarray, batch: int, where: str) -> tuple[int, ...]:
        """Where batch `batch`'s chunks lie in its shard, from the shard's `index`."""
        slots = self.encoder.slots
        return ragged.batch_place(index[(batch % self.per_shard) * slots :][:slots], self.encoder, where)

    def decode(self, data: bytes, place: tuple[int, ...], where: str) -> np.ndarray:
        """The batch's values from the bytes at its `place` (laid end to end, the last chunk's
        padding included)."""
        if len(data) != place[1]:
            raise FormatError(f"{where}: the shard {self.holder} is truncated")
        return self.encoder.decode(data, place, where)


class ValuesReader(ValuesLayout):
    """A ragged field's values of one batch straight from a local shard file, by one pread."""

    def __init__(self, root: DatasetRoot, arr: ArrayMeta) -> None:
        super().__init__(arr)
        self._shards = ShardFiles(root, arr, self.positions)

    @classmethod
    def for_array(cls, root: DatasetRoot, arr: ArrayMeta) -> ValuesReader | None:
        return cls(root, arr) if ragged.is_values(arr) and ragged.own_layout(arr) else None

    def read(self, batch: int) -> np.ndarray:
        """Batch `batch`'s values, laid end to end (its last chunk's padding included)."""
        held = self._shards.get(batch // self.per_shard)  # kept while this read uses it: closed with the last holder
        where = self.where(batch)
        place = self.place(held.index, batch, where)
        return self.decode(os.pread(held.file.fileno(), place[1], place[0]), place, where)


class BatchValues(Protocol):
    """A ragged field's values, batch by batch (`ValuesReader`; `remote.RemoteValuesReader`)."""

    def read(self, batch: int) -> np.ndarray: ...


def batch_values(reader: BatchValues | None, arr: Any, batch: int, offsets: np.ndarray, where: str) -> np.ndarray:
    """Batch `batch`'s values of a ragged field: by batchctl's own reader where it has one (a
    layout batchctl writes), else through zarr (`arr`), as far as the batch's rows reach (their
    `offsets`)."""
    if reader is not None:
        return reader.read(batch)
    end = int(offsets[:, 1].max()) if len(offsets) else 0
    try:
        return np.asarray(arr[batch, :end])
    except (RuntimeError, ValueError) as exc:  # what the decoders raise on bad bytes
        raise FormatError(f"{where}: corrupt data ({exc})") from exc


class ShardFiles:
    """The last few shard files of one array a reader used: each opened, mapped, and its index of
    `positions` entries read and checked against its crc32c. A file dropped from the few closes
    when the last read holding it lets go (`_OpenShard`)."""

    def __init__(self, root: DatasetRoot, arr: ArrayMeta, positions: int) -> None:
        self.root, self.arr, self.positions = root, arr, positions
        self.index_bytes = positions * 16 + 4
        self._open: dict[int, _OpenShard] = {}
        self._lock = threading.Lock()  # prefetch threads share the cache

    def get(self, shard: int) -> _OpenShard:
        with self._lock:
            held = self._open.get(shard)
            if held is None:
                held = self._opened(shard)
                if len(self._open) >= _SHARD_CACHE:
                    self._open.pop(next(iter(self._open)))  # closed once no read holds it
                self._open[shard] = held
        return held

    def _opened(self, shard: int) -> _OpenShard:
        file = self.root.open(self.arr.shard_key(shard), f"{self.arr.name} shard {shard}")
        size = os.fstat(file.fileno()).st_size
        raw = os.pread(file.fileno(), self.index_bytes, size - self.index_bytes) if size >= self.index_bytes else b""
        index = parse_shard_index(raw, self.positions, f"{self.arr.name} shard {shard}")
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        return _OpenShard(file, mapped, index)


class _OpenShard:
    """A shard file opened for reading, its mapping and its index; the file is closed when the last
    reader lets go of it (no ResourceWarning for a file left to the garbage collector)."""

    __slots__ = ("file", "index", "mapped")

    def __init__(self, file: io.FileIO, mapped: mmap.mmap, index: np.ndarray) -> None:
        self.file, self.mapped, self.index = file, mapped, index

    def __del__(self) -> None:
        self.file.close()


def decode_chunk(inner: list[str], data: memoryview, out: np.ndarray, where: str) -> None:
    """One stored chunk's bytes (compressed, or raw with a crc32c) into `out` (flat uint8),
    checking its checksum (libzstd checks a zstd frame's own)."""
    if inner[-1] == "crc32c":
        data, stored_crc = data[:-4], data[-4:]
        if crc32c(data) != int.from_bytes(stored_crc, "little"):
            raise FormatError(f"{where}: the chunk checksum does not match")
    if "zstd" in inner:
        import numcodecs  # (~40 ms, paid at the first compressed chunk read, not by all that import this module)

        numcodecs.Zstd().decode(data, out=out)
    elif "blosc" in inner:
        import numcodecs

        numcodecs.Blosc().decode(data, out=out)
    elif len(data) != out.nbytes:
        raise FormatError(f"{where}: the chunk holds {len(data)} bytes, not {out.nbytes}")
    else:
        out[:] = np.frombuffer(data, np.uint8)


def row_views(rows: list[np.ndarray], chunk_bytes: int) -> list[np.ndarray]:
    """The buffers a chunk is read into, as flat bytes: C-contiguous (a reshape of any other
    would be a copy, written instead of them) and one chunk's bytes together."""
    if not all(row.flags.c_contiguous for row in rows):
        raise ValueError("every buffer must be C-contiguous (a copy would be written instead)")
    views = [row.reshape(-1).view(np.uint8) for row in rows]
    if sum(view.nbytes for view in views) != chunk_bytes:
        raise ValueError(f"the buffers hold {sum(view.nbytes for view in views)} bytes, a chunk {chunk_bytes}")
    return views


def spread(whole: np.ndarray, rows: list[np.ndarray]) -> None:
    """A decoded chunk's bytes into the buffers laid end to end."""
    at = 0
    for row in rows:
        row[:] = whole[at : at + row.nbytes]
        at += row.nbytes


@contextlib.contextmanager
def corrupt_data_named(name: str, chunk: int) -> Iterator[None]:
    """What the decoders raise on bad bytes, as a FormatError naming the array and batch."""
    try:
        yield
    except FormatError:
        raise
    except (RuntimeError, ValueError) as exc:
        raise FormatError(f"{name} batch {chunk}: corrupt data ({exc}); `batchctl verify` lists all") from exc
