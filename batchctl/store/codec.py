"""The shard codec: one chunk (one batch) encoded and decoded exactly as zarr-python does inside
a `sharding_indexed` shard, and the index that ends a shard. batchctl writes its shards itself
(zarr 3.1 rewrites a whole shard for any write into it) and reads them itself (several times
zarr-python's speed); `own_codecs` says which layouts these apply to.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from batchctl.errors import FormatError
from batchctl.store.crc import crc32c
from batchctl.store.zarrmeta import ArrayMeta

NO_CHUNK = 2**64 - 1  # an index entry of an empty chunk in the sharding_indexed codec


_INNER_CODECS = (["bytes", "zstd"], ["bytes", "blosc", "crc32c"], ["bytes", "crc32c"])


def own_codecs(arr: ArrayMeta) -> list[dict[str, Any]] | None:
    """The inner codecs of `arr` when its layout is the one batchctl writes and decodes itself
    (`ChunkReader`, `ChunkEncoder`), else None:
    `sharding_indexed` with the index at the end (little-endian uint64 offset/nbytes pairs plus
    crc32c), one chunk across all but the first dimension, inner codecs bytes + zstd,
    bytes + blosc + crc32c, or bytes + crc32c, little-endian numbers."""
    try:
        kind = np.dtype(arr.dtype)
    except TypeError:
        return None
    config = arr.sharding
    if kind.kind not in "biuf" or config is None:
        return None
    inner = list(config.get("codecs", ()))
    names = [codec["name"] for codec in inner]
    index_names = [codec["name"] for codec in config.get("index_codecs", ())]
    endian = (inner[0].get("configuration") or {}).get("endian", "little") if inner else None
    little = kind.byteorder in "<|=" and endian == "little"
    if (
        config.get("index_location") != "end"
        or index_names != ["bytes", "crc32c"]
        or names not in _INNER_CODECS
        or not little
        or len(arr.chunks) != arr.ndim
        or any(int(s) != int(c) for s, c in zip(arr.grid[1:], arr.chunks[1:], strict=True))
    ):
        return None
    return inner


class ChunkEncoder:
    """Encodes one chunk (one batch) of an array exactly as zarr-python would inside a
    `sharding_indexed` shard (tests/test_transport.py compares the bytes): zstd with its frame
    checksum, or blosc then crc32c, or the raw little-endian bytes then crc32c. A short last
    batch is padded with the fill value, as zarr does. zstd, blosc and crc32c release the GIL."""

    def __init__(self, arr: ArrayMeta, inner: list[dict[str, Any]]) -> None:
        self.chunk_shape = tuple(int(n) for n in arr.chunks)
        self.dtype = np.dtype(arr.dtype)
        self.fill = arr.fill_value
        names = [codec["name"] for codec in inner]
        config = inner[1].get("configuration") or {}
        self.compressor: Any = None
        import numcodecs  # (~40 ms, paid by the processes that code chunks, not by all that import this module)

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
    def for_array(cls, arr: ArrayMeta) -> ChunkEncoder:
        inner = own_codecs(arr)
        if inner is None:
            raise FormatError(f"{arr.name}: not a layout batchctl writes (docs/format.md)")
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
            if crc32c(data) != int.from_bytes(stored, "little"):
                raise FormatError("the chunk checksum does not match")
        raw = self.compressor.decode(data) if self.compressor is not None else data
        return np.frombuffer(raw, dtype=self.dtype.newbyteorder("<")).reshape(self.chunk_shape).copy()


def shard_index_bytes(entries: Sequence[tuple[int, ...]], positions: int) -> list[Any]:
    """The index that ends a shard: (offset, nbytes) of each of its `positions` chunks,
    little-endian uint64, an empty position marked as all ones, then its crc32c."""
    index = np.full((positions, 2), NO_CHUNK, dtype="<u8")
    for position, entry in enumerate(entries):
        index[position] = entry[:2]
    index_bytes = index.reshape(-1).view(np.uint8)
    return [index_bytes, _crc32c_bytes(index_bytes)]


def read_shard_index(path: Path, shard_batches: int) -> list[list[int]]:
    """The (offset, nbytes) of each chunk of a local shard file, from its index (checked)."""
    nbytes = shard_batches * 16 + 4
    with open(path, "rb") as file:
        file.seek(-nbytes, os.SEEK_END)
        raw = file.read(nbytes)
    return parse_shard_index(raw, shard_batches, str(path)).tolist()  # type: ignore[no-any-return]


def parse_shard_index(raw: bytes, shard_batches: int, where: str = "") -> np.ndarray:
    """A shard index's bytes as (offset, nbytes) rows, uint64, an absent chunk's NO_CHUNK;
    checked against its crc32c first (a mismatch is a `FormatError` naming `where`)."""
    if len(raw) != shard_batches * 16 + 4 or crc32c(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
        raise FormatError(f"{where}: " * bool(where) + "the shard index checksum does not match")
    return np.frombuffer(raw[:-4], dtype="<u8").reshape(shard_batches, 2)


def _crc32c_bytes(data: Any) -> bytes:
    return crc32c(data).to_bytes(4, "little")
