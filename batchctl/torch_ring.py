"""The batch ring: how a DataLoader worker hands its batches to the main process without copying them.

A batch made in a DataLoader worker crosses to the main process through shared memory: torch
copies each tensor into a new segment (its pages zeroed and touched: ~6 ms for a 9.6 MB batch)
and the main process maps it, which cost more than reading the batch (issue 44). Instead
`IterableBatches` makes one anonymous shared segment of slots before the workers start; a worker
reads an output batch straight into a free slot (`allocate`: the loader's output arrays are the
slot's memory), and sends a small `SlotBatch` naming the slot. Unpickled in the main process, it
becomes tensors over the main process's own mapping of that slot, and the slot is free again when
the last of them is gone (`weakref.finalize`), so a batch the training loop keeps is never written
over. A worker that finds no free slot (the loop holds many batches, or batches were dropped
unread when a DataLoader stopped early) makes its batch as before: nothing waits, nothing is
wrong, it is only slower.

The segment is a memfd (freed by the kernel with the last process that maps it, however the run
ends) of `SLOTS` slots; only the pages of slots in use are ever touched.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import uuid
import weakref
from collections.abc import Mapping
from multiprocessing.sharedctypes import Array
from typing import Any

import numpy as np

from batchctl.run.mpinternals import dup_fd_for_child, pickled_for_a_child

# batches in the ring: a worker's loader makes all the output batches a group of `mix` stored
# batches feeds when the group's reads start, and reads `prefetch` more ahead (at mix=16, about
# 48 batches a worker); then the DataLoader's prefetch and the loop's own. Only slots in use are
# ever touched: the ring's memory is the batches in flight, as it was without it.
SLOTS = 256
ALIGN = 64
_RINGS: dict[str, BatchRing] = {}  # the rings made in this process, for `SlotBatch` to find


class BatchRing:
    """Slots of `slot_bytes` shared by the process that made the ring and its DataLoader workers."""

    def __init__(self, slot_bytes: int, slots: int | None = None) -> None:
        self.token = uuid.uuid4().hex
        self.slot_bytes = -(-slot_bytes // ALIGN) * ALIGN
        self.slots = SLOTS if slots is None else slots
        self.busy: Any = Array("b", self.slots)  # 1: the slot's batch is being made, in flight, or held
        self._fd = os.memfd_create("batchctl-batches", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, self.slots * self.slot_bytes)
        self._map: mmap.mmap | None = None
        self._base = 0
        _RINGS[self.token] = self

    @classmethod
    def create(cls, slot_bytes: int) -> BatchRing | None:
        """A ring, or None where there is no memfd or no room: batches then travel as torch sends them."""
        if not hasattr(os, "memfd_create") or slot_bytes <= 0:
            return None
        try:
            return cls(slot_bytes)
        except OSError:
            return None

    def __getstate__(self) -> dict[str, Any]:
        fd = dup_fd_for_child(self._fd) if pickled_for_a_child() else None  # (a copy elsewhere cannot map it)
        return {**self.__dict__, "_fd": fd, "_map": None, "_base": 0}

    def __setstate__(self, state: dict[str, Any]) -> None:
        fd = state["_fd"]
        self.__dict__.update(state, _fd=fd.detach() if fd is not None else -1)

    def _buffer(self) -> mmap.mmap:
        if self._map is None:
            self._map = mmap.mmap(self._fd, self.slots * self.slot_bytes)
            self._base = np.frombuffer(self._map, np.uint8, count=1).__array_interface__["data"][0]
        return self._map

    def allocate(self, rows: int, fields: Mapping[str, tuple[tuple[int, ...], Any]]) -> dict[str, np.ndarray] | None:
        """An output batch's numeric arrays in a free slot (taken), or None: none is free, or the
        batch does not fit one."""
        layout = _layout(rows, fields)
        if not layout or _end(layout) > self.slot_bytes or self._fd < 0:
            return None
        slot = self._take()
        if slot is None:
            return None
        return _views(self._buffer(), slot * self.slot_bytes, layout)

    def _take(self) -> int | None:
        with self.busy.get_lock():
            for slot in range(self.slots):
                if not self.busy[slot]:
                    self.busy[slot] = 1
                    return slot
        return None

    def release(self, slot: int) -> None:
        with self.busy.get_lock():
            self.busy[slot] = 0

    def slot_of(self, array: np.ndarray) -> int | None:
        """The slot `array` lies in, or None (an array made elsewhere)."""
        if self._map is None:
            return None
        at = array.__array_interface__["data"][0] - self._base
        return at // self.slot_bytes if 0 <= at < self.slots * self.slot_bytes else None

    def message(self, batch: Mapping[str, Any], converted: Mapping[str, Any]) -> SlotBatch | None:
        """What a worker sends for `batch`, whose numeric arrays lie in one slot: the slot and where
        each lies in it, the other fields (`converted`: as torch tensors or lists) sent as they are."""
        placed: dict[str, tuple[str, tuple[int, ...], int]] = {}
        slot = None
        for name, values in batch.items():
            found = self.slot_of(values) if isinstance(values, np.ndarray) and values.dtype != object else None
            if found is None:
                continue
            if slot is not None and found != slot:
                return None
            slot = found
            at = values.__array_interface__["data"][0] - self._base - found * self.slot_bytes
            placed[name] = (values.dtype.str, tuple(values.shape), at)
        if slot is None:
            return None
        others = {name: value for name, value in converted.items() if name not in placed}
        return SlotBatch(self.token, slot, list(batch), placed, others)

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            if self._map is not None:
                self._map.close()
                self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class SlotBatch:
    """A batch as a worker sends it: its slot, its numeric fields' places there, its other fields.
    Unpickled where the ring was made, it is the batch, as tensors over that process's mapping."""

    def __init__(
        self,
        token: str,
        slot: int,
        names: list[str],
        placed: dict[str, tuple[str, tuple[int, ...], int]],
        others: dict[str, Any],
    ) -> None:
        self.token, self.slot, self.names, self.placed, self.others = token, slot, names, placed, others

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _rebuild, (self.token, self.slot, self.names, self.placed, self.others)


def _rebuild(
    token: str, slot: int, names: list[str], placed: dict[str, tuple[str, tuple[int, ...], int]], others: dict[str, Any]
) -> dict[str, Any]:
    import torch

    ring = _RINGS.get(token)
    if ring is None:
        raise RuntimeError("a batchctl batch left the process of its IterableBatches (its ring is not here)")
    start = slot * ring.slot_bytes
    owner = np.frombuffer(ring._buffer(), np.uint8, count=ring.slot_bytes, offset=start)  # the slot, while in use
    weakref.finalize(owner, ring.release, slot)
    tensors = {
        name: torch.from_numpy(owner[at : at + _nbytes(dtype, shape)].view(dtype).reshape(shape))
        for name, (dtype, shape, at) in placed.items()
    }
    return {name: tensors[name] if name in tensors else others[name] for name in names}


Layout = dict[str, tuple[np.dtype[Any], tuple[int, ...], int]]  # field -> (dtype, shape, offset in the slot)


def _layout(rows: int, fields: Mapping[str, tuple[tuple[int, ...], Any]]) -> Layout:
    layout: Layout = {}
    at = 0
    for name, (shape, dtype) in fields.items():
        kind = np.dtype(dtype)
        layout[name] = (kind, (rows, *shape), at)
        at += -(-_nbytes(kind.str, (rows, *shape)) // ALIGN) * ALIGN
    return layout


def _end(layout: Layout) -> int:
    return max(at + _nbytes(kind.str, shape) for kind, shape, at in layout.values())


def _views(buffer: mmap.mmap, start: int, layout: Layout) -> dict[str, np.ndarray]:
    return {name: np.ndarray(shape, kind, buffer, start + at) for name, (kind, shape, at) in layout.items()}


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return int(np.prod(shape)) * np.dtype(dtype).itemsize


def slot_bytes(batch_rows: int, fields: Mapping[str, tuple[tuple[int, ...], Any]]) -> int:
    """The bytes a slot needs for a batch of `batch_rows` rows of these numeric fields."""
    layout = _layout(batch_rows, fields)
    return _end(layout) if layout else 0
