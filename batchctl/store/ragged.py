"""A ragged field's rows as the format stores them (docs/format.md): per batch, offsets ([start,
stop) of each row) and the rows' values end to end in the batch's row of `F.values`, in chunks
(raw with a crc32c, or zstd frames); encoded, indexed and read back here, so the collator, the
Dask engine, the readers and an incremental build's carry agree on it."""

from __future__ import annotations

from typing import Any

import numpy as np

from batchctl.errors import FormatError
from batchctl.store.codec import NO_CHUNK, _crc32c_bytes
from batchctl.store.crc import crc32c
from batchctl.store.journal import Chunk
from batchctl.store.metadata import FieldSpec
from batchctl.store.zarrmeta import ArrayMeta


def is_values(arr: ArrayMeta) -> bool:
    """Whether `arr` is a ragged field's values: a batch a row, its chunks not spanning the row."""
    return arr.ndim >= 2 and tuple(arr.chunks[1:]) != tuple(arr.grid[1:])


def own_layout(arr: ArrayMeta) -> bool:
    """Whether a ragged field's values are laid out as batchctl writes them (`ValuesEncoder`):
    little-endian chunks, raw with a crc32c or zstd-compressed, the index at the end, a batch a row."""
    config = arr.sharding or {}
    inner = [codec.get("name") for codec in config.get("codecs", ())]
    index = [codec.get("name") for codec in config.get("index_codecs", ())]
    endian = ((config.get("codecs") or [{}])[0].get("configuration") or {}).get("endian", "little")
    return (
        inner in (["bytes", "crc32c"], ["bytes", "zstd"])
        and index == ["bytes", "crc32c"]
        and config.get("index_location") == "end"
        and endian == "little"
        and int(arr.chunks[0]) == 1
        and np.dtype(arr.dtype).kind in "biuf"
        and int(arr.grid[1]) % int(arr.chunks[1]) == 0
        and tuple(arr.grid[2:]) == tuple(arr.chunks[2:])
    )


class ValuesEncoder:
    """A batch's values of a ragged field as the chunks of its row of `F.values` (docs/format.md):
    `per_chunk` values a chunk, the last padded with the fill value, each chunk its little-endian
    bytes then a crc32c (every chunk the same stored size), or zstd-compressed with its frame
    checksum (each chunk's size in the batch's place: `Chunk` `(offset, nbytes, size, ...)`)."""

    def __init__(self, arr: ArrayMeta) -> None:
        self.chunk_shape = tuple(int(n) for n in arr.chunks)  # (1, per_chunk, *rest)
        self.per_chunk = self.chunk_shape[1]
        self.slots = int(arr.grid[1]) // self.per_chunk  # chunks a batch may span
        self.dtype = np.dtype(arr.dtype)
        self.fill = arr.fill_value
        self.chunk_bytes = int(np.prod(self.chunk_shape)) * self.dtype.itemsize
        self.stored = self.chunk_bytes + 4  # a raw chunk's stored size
        self.name = arr.name
        inner = (arr.sharding or {}).get("codecs", ())
        self.zstd: Any = None
        if any(codec.get("name") == "zstd" for codec in inner):
            import numcodecs  # (~40 ms, paid by the processes that code compressed values)

            config = next(codec.get("configuration") or {} for codec in inner if codec.get("name") == "zstd")
            self.zstd = numcodecs.Zstd(level=config.get("level", 0), checksum=config.get("checksum", False))

    @property
    def capacity(self) -> int:
        return self.slots * self.per_chunk

    def encode(self, values: np.ndarray) -> list[list[Any]]:
        """Each chunk's stored pieces, in order (none for a batch without values)."""
        count = -(-len(values) // self.per_chunk)
        if count > self.slots:
            raise FormatError(
                f"a batch of {self.name} holds {len(values)} values, more than the {self.capacity} a batch of this "
                "dataset can hold (256 chunks of the size its first sample suggested): rebuild with a smaller "
                "--batch-size (or --force, for a new chunk size)"
            )
        padded = np.full((count * self.per_chunk, *self.chunk_shape[2:]), self.fill, dtype=self.dtype.newbyteorder("<"))
        padded[: len(values)] = values
        raw = padded.reshape(-1).view(np.uint8)
        pieces = [raw[i * self.chunk_bytes : (i + 1) * self.chunk_bytes] for i in range(count)]
        if self.zstd is not None:
            return [[self.zstd.encode(piece)] for piece in pieces]
        return [[piece, _crc32c_bytes(piece)] for piece in pieces]

    def place(self, offset: int, sizes: list[int]) -> Chunk:
        """A batch's place in its shard: its chunks' `sizes` from `offset` (raw chunks all have one
        size, so their place is `(offset, nbytes)` as any array's)."""
        total = sum(sizes)
        return (offset, total) if self.zstd is None else (offset, total, *sizes)

    def sizes(self, place: Chunk) -> list[int]:
        """Each chunk's stored size, from a batch's place."""
        if self.zstd is None:
            return [self.stored] * (place[1] // self.stored)
        return list(place[2:])

    def decode(self, data: bytes | memoryview, place: Chunk, where: str = "") -> np.ndarray:
        """A batch's stored chunks (at `place`), laid end to end, back to its values (padding
        included), every chunk's checksum checked."""
        view = memoryview(data).cast("B")
        sizes = self.sizes(place)
        if sum(sizes) != len(view) or (self.zstd is None and len(view) % self.stored):
            raise FormatError(f"{where}: " * bool(where) + "the values are not whole chunks")
        out = np.empty(len(sizes) * self.chunk_bytes, np.uint8)
        at = 0
        for i, size in enumerate(sizes):
            chunk, target = view[at : at + size], out[i * self.chunk_bytes : (i + 1) * self.chunk_bytes]
            at += size
            if self.zstd is not None:
                try:
                    self.zstd.decode(chunk, out=target)  # libzstd checks the frame's checksum
                except (RuntimeError, ValueError) as exc:
                    raise FormatError(f"{where}: " * bool(where) + f"corrupt data ({exc})") from exc
            elif crc32c(chunk[:-4]) != int.from_bytes(chunk[-4:], "little"):
                raise FormatError(f"{where}: " * bool(where) + "the chunk checksum does not match")
            else:
                target[:] = np.frombuffer(chunk[:-4], np.uint8)
        return out.view(self.dtype.newbyteorder("<")).reshape(-1, *self.chunk_shape[2:])


def index_entries(place: Chunk, encoder: ValuesEncoder) -> list[tuple[int, int]]:
    """The index entries of one batch's values at `place`: each chunk's, then empty positions up
    to the encoder's slots."""
    entries, at = [], place[0]
    for size in encoder.sizes(place):
        entries.append((at, size))
        at += size
    return entries + [(NO_CHUNK, NO_CHUNK)] * (encoder.slots - len(entries))


def columns_of(rows: np.ndarray, spec: FieldSpec) -> tuple[np.ndarray, np.ndarray]:
    """A batch's rows of a ragged field (an object array of arrays) as its offsets ([start, stop)
    of each row) and its values end to end."""
    lengths = np.fromiter((len(row) for row in rows), np.int64, len(rows))
    stops = np.cumsum(lengths)
    offsets = np.stack([stops - lengths, stops], axis=1)
    present = [row for row in rows if len(row)]
    values = np.concatenate(present) if present else np.empty((0, *spec.shape), spec.dtype)
    return offsets, values


def rows_of(offsets: np.ndarray, values: np.ndarray, where: str = "") -> np.ndarray:
    """The rows of a ragged field (an object array of views of `values`), from their offsets,
    which must lay the rows end to end from 0 within the values (a `FormatError` otherwise)."""
    starts, stops = offsets[:, 0], offsets[:, 1]
    if len(offsets) and (
        starts[0] != 0 or (stops < starts).any() or (starts[1:] != stops[:-1]).any() or stops[-1] > len(values)
    ):
        raise FormatError(f"{where}: " * bool(where) + "the offsets do not lay the rows end to end within the values")
    rows = np.empty(len(offsets), dtype=object)
    for i, (start, stop) in enumerate(offsets.tolist()):
        rows[i] = values[start:stop]
    return rows


def batch_place(entries: np.ndarray, encoder: ValuesEncoder, where: str) -> Chunk:
    """Where one batch's values lie in its shard file, from its index entries: its chunks, the
    first ones of its slots, one after another (raw ones each of the stored size); anything else
    is damage."""
    present = entries[:, 0] != NO_CHUNK
    count = int(present.sum())
    if not count:
        return 0, 0
    offsets, sizes = entries[:count, 0].astype(np.int64), entries[:count, 1].astype(np.int64)
    expected = int(offsets[0]) + np.concatenate([[0], np.cumsum(sizes)[:-1]])
    raw_sizes = encoder.zstd is None and bool((sizes != encoder.stored).any())
    if not present[:count].all() or raw_sizes or (offsets != expected).any():
        raise FormatError(f"{where}: the values' chunks are not where the layout puts them")
    return encoder.place(int(offsets[0]), [int(n) for n in sizes])


def batch_places(index: np.ndarray, encoder: ValuesEncoder, where: str) -> list[Chunk]:
    """Each batch's place from a values shard's index, as the collator journals them: a batch
    without values at the end of the one before it, with no bytes."""
    places: list[Chunk] = []
    end = 0
    for batch in range(len(index) // encoder.slots):
        place = batch_place(index[batch * encoder.slots :][: encoder.slots], encoder, where)
        if place[1]:
            end = place[0] + place[1]
        places.append(place if place[1] else (end, 0))
    return places
