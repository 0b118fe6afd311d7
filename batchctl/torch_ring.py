"""The batch ring: how a DataLoader worker hands its batches to the main process without copying them.

A batch made in a DataLoader worker crosses to the main process through shared memory: torch
copies each tensor into a new segment (its pages zeroed and touched: ~6 ms for a 9.6 MB batch)
and the main process maps it, which cost more than reading the batch. Instead
`IterableBatches` makes one anonymous shared segment of slots before the workers start; a worker
reads an output batch straight into a free slot (`allocate`: the loader's output arrays are the
slot's memory), and sends a small `SlotBatch` naming the slot. Unpickled in the main process, it
becomes tensors over the main process's own mapping of that slot, and the slot is free again when
the last of them is gone (`weakref.finalize`), so a batch the training loop keeps is never written
over. A worker that finds no free slot (the loop holds many batches, or batches were dropped
unread when a DataLoader stopped early) makes its batch as before: nothing waits, nothing is
wrong, it is only slower.

The segment is a memfd (freed by the kernel with the last process that maps it, however the run
ends) of `SLOTS` slots; only the pages of slots in use are ever touched. A ring goes with its
`IterableBatches` and the last batch of it the loop held: its descriptors are closed then, so a
training script that makes streams again and again keeps no memory or descriptor of old ones.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import tempfile
import threading
import uuid
import weakref
from collections.abc import Iterator, Mapping
from multiprocessing.sharedctypes import RawArray
from typing import Any, cast

import numpy as np

from batchctl.read.loader import batch_layout, field_view
from batchctl.run.mpinternals import dup_fd_for_child, pickled_for_a_child

# batches in the ring: a worker's loader makes all the output batches a group of `mix` stored
# batches feeds when the group's reads start, and reads `prefetch` more ahead (at mix=16, about
# 48 batches a worker); then the DataLoader's prefetch and the loop's own. Only slots in use are
# ever touched: the ring's memory is the batches in flight, as it was without it.
SLOTS = 256
# the rings made in this process, for `SlotBatch` to find (held by their stream and by the
# batches received in them, not by this)
_RINGS: weakref.WeakValueDictionary[str, BatchRing] = weakref.WeakValueDictionary()
_WORKER_RINGS: dict[str, BatchRing] = {}  # the rings this process made batches in (a DataLoader worker's)


class SharedLock:
    """A lock held by one of a process and its DataLoader workers at a time, however they were
    started (fork, spawn: macOS's default, forkserver): a POSIX record lock on an unlinked
    temporary file, whose descriptor travels to a spawned worker as it starts, and a thread lock
    for the threads of one process (record locks are per process). Not a multiprocessing lock: one
    made in the default (fork) context refuses to go to a spawned worker, and one of another
    context is a named semaphore that starts a resource tracker in the training process."""

    def __init__(self) -> None:
        with tempfile.TemporaryFile() as file:
            self._fd = os.dup(file.fileno())
        self._threads = threading.Lock()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        with self._threads:
            fcntl.lockf(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN)

    def __getstate__(self) -> dict[str, Any]:
        if not pickled_for_a_child():
            raise TypeError("a SharedLock goes only to a process being started")
        return {"fd": dup_fd_for_child(self._fd)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._fd, self._threads = state["fd"].detach(), threading.Lock()

    def __del__(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.close(self._fd)


class BatchRing:
    """Slots of `slot_bytes` shared by the process that made the ring and its DataLoader workers."""

    def __init__(self, slot_bytes: int, slots: int | None = None) -> None:
        self.token = uuid.uuid4().hex
        self.slot_bytes = slot_bytes  # (`batch_layout`'s sizes: already a multiple of its alignment)
        self.slots = SLOTS if slots is None else slots
        self.busy: Any = RawArray("b", self.slots)  # 1: the slot's batch is being made, in flight, or held
        self.lock = SharedLock()  # taking a slot
        self._fd = os.memfd_create("batchctl-batches", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, self.slots * self.slot_bytes)
        self._map: mmap.mmap | None = None
        self._base = 0
        self._sent: dict[int, list[bool]] = {}  # per slot this process made a batch in: sent to the main process
        self.pid = os.getpid()  # the process the ring was made in, where batches are unpickled
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
        return {**self.__dict__, "_fd": fd, "_map": None, "_base": 0, "_sent": {}}

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
        batch does not fit one. The slot is freed when the main process lets go of the batch, or
        when this process does without having sent it (a loop that made a new batch of it)."""
        layout, size = batch_layout(rows, fields)
        claimed = self._claim(size)
        if claimed is None:
            return None
        _, owner = claimed
        return {name: field_view(owner, kind, shape, at) for name, (kind, shape, at) in layout.items()}

    def _claim(self, size: int) -> tuple[int, np.ndarray] | None:
        """A free slot for `size` bytes of arrays (taken: freed as `allocate` says), and its memory."""
        if not size or size > self.slot_bytes or self._fd < 0:
            return None
        slot = self._take()
        if slot is None:
            return None
        _WORKER_RINGS[self.token] = self
        owner = np.frombuffer(self._buffer(), np.uint8, count=self.slot_bytes, offset=slot * self.slot_bytes)
        sent = self._sent[slot] = [False]
        weakref.finalize(owner, self._dropped, slot, sent, os.getpid())
        return slot, owner

    def _take(self) -> int | None:
        with self.lock.held():
            for slot in range(self.slots):
                if not self.busy[slot]:
                    self.busy[slot] = 1
                    return slot
        return None

    def release(self, slot: int) -> None:
        self.busy[slot] = 0  # (one byte: only a slot taken is let go, by the one process holding it)

    def _dropped(self, slot: int, sent: list[bool], pid: int) -> None:
        """This process let go of a batch it made in `slot`: free the slot unless it was sent
        (or this is a forked copy of that process, which let go of nothing)."""
        if not sent[0] and os.getpid() == pid:
            self.release(slot)

    def _received_dropped(self, slot: int) -> None:
        """The main process let go of a batch it received in `slot` (not a forked copy of it)."""
        if os.getpid() == self.pid:
            self.release(slot)

    def place(self, value: Any) -> tuple[int, int] | None:
        """(slot, offset in it) of a contiguous tensor or array lying in this process's mapping."""
        if self._map is None:
            return None
        array = _array(value)
        if array is None:
            return None
        at = array.__array_interface__["data"][0] - self._base
        slot, within = divmod(at, self.slot_bytes)
        if not 0 <= slot < self.slots or within + array.nbytes > self.slot_bytes:
            return None
        return slot, within

    def pack(
        self, batch: Mapping[str, Any]
    ) -> tuple[BatchRing, int, dict[str, tuple[str, tuple[int, ...], int]]] | None:
        """Copy the contiguous numeric fields of `batch` into a free slot, to be sent now: the slot
        and their places, or None (none free, or they do not fit)."""
        arrays = {name: array for name, value in batch.items() if (array := _array(value)) is not None}
        layout, size = batch_layout(1, {name: (array.shape, array.dtype) for name, array in arrays.items()})
        claimed = self._claim(size)
        if claimed is None:
            return None
        slot, owner = claimed
        placed = {name: (array.dtype.str, tuple(array.shape), layout[name][2]) for name, array in arrays.items()}
        for name, (dtype, shape, at) in placed.items():
            field_view(owner, dtype, shape, at)[...] = arrays[name]
        self._sent[slot][0] = True  # (before `owner` goes: nothing here holds the copy, the main process frees it)
        return self, slot, placed

    def slot_of(self, value: Any) -> int | None:
        """The slot `value` lies in, or None (made elsewhere)."""
        found = self.place(value)
        return None if found is None else found[0]

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            if self._map is not None:
                self._map.close()
                self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        # no batch of it is held here (each holds the ring through its finalizer): the memfd's
        # descriptor goes, and the mapping with the last array over it
        with contextlib.suppress(OSError, AttributeError):
            if self._fd >= 0:
                os.close(self._fd)


PACK_BYTES = 2**16  # a batch holding a new array this big is copied whole into a free slot to be sent


class SlotBatch(dict[str, Any]):
    """A batch as a DataLoader worker yields it: a dict, to code in the worker as any batch (it
    may read, change or replace its fields). Pickled for the main process, the tensors that still
    lie in one slot of the worker's ring are sent as that slot and their places in it, the rest as
    torch sends them; where a field was replaced by a big new array (a `transform`), the numeric
    fields are copied into a free slot first (one copy into warm pages, against torch's copy
    into a new segment). Unpickled where the ring was made, it is a dict of tensors over that
    process's mapping of the slot, which is freed when the last of them is gone."""

    def __copy__(self) -> SlotBatch:  # (torch's default_convert copies a batch: a copy is not a sending)
        return SlotBatch(self)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        placed: dict[str, tuple[str, tuple[int, ...], int]] = {}
        others: dict[str, Any] = {}
        ring, slot = None, None
        for name, value in self.items():
            for candidate in _WORKER_RINGS.values():
                found = candidate.place(value)
                if found is not None and (slot is None or (candidate is ring and found[0] == slot)):
                    ring, slot = candidate, found[0]
                    placed[name] = (cast(np.ndarray, _array(value)).dtype.str, tuple(value.shape), found[1])
                    break
            else:
                others[name] = value
        new = [
            value for value in others.values() if (array := _array(value)) is not None and array.nbytes >= PACK_BYTES
        ]
        if new and _WORKER_RINGS:
            packed = next(iter(_WORKER_RINGS.values())).pack(self)
            if packed is not None:
                ring, slot, placed = packed
                others = {name: value for name, value in self.items() if name not in placed}
        if ring is None or slot is None:
            return dict, (dict(self),)
        ring._sent[slot][0] = True  # the main process frees it now
        return _rebuild, (ring.token, slot, list(self), placed, others)


def _rebuild(
    token: str, slot: int, names: list[str], placed: dict[str, tuple[str, tuple[int, ...], int]], others: dict[str, Any]
) -> dict[str, Any]:
    import torch

    ring = _RINGS.get(token)
    if ring is None or ring.pid != os.getpid():
        raise RuntimeError("a batchctl batch left the process of its IterableBatches (its ring is not here)")
    start = slot * ring.slot_bytes
    owner = np.frombuffer(ring._buffer(), np.uint8, count=ring.slot_bytes, offset=start)  # the slot, while in use
    weakref.finalize(owner, ring._received_dropped, slot)
    tensors = {
        name: torch.from_numpy(field_view(owner, dtype, shape, at)) for name, (dtype, shape, at) in placed.items()
    }
    return {name: tensors[name] if name in tensors else others[name] for name in names}


def _array(value: Any) -> np.ndarray | None:
    """A contiguous CPU tensor's or array's memory as an array (no copy), else None."""
    if hasattr(value, "untyped_storage"):  # a torch tensor
        if value.device.type != "cpu" or not value.is_contiguous() or value.requires_grad:
            return None
        try:
            value = value.numpy()
        except (TypeError, RuntimeError):  # a dtype NumPy lacks (bfloat16): not ours
            return None
    if isinstance(value, np.ndarray) and value.dtype != object and value.flags.c_contiguous:
        return value
    return None


def slot_bytes(batch_rows: int, fields: Mapping[str, tuple[tuple[int, ...], Any]]) -> int:
    """The bytes a slot needs for a batch of `batch_rows` rows of these numeric fields."""
    return batch_layout(batch_rows, fields)[1]
