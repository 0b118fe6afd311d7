"""Read: a built dataset as batches of NumPy arrays, with no framework dependency.

`open(path)` returns a `Dataset`; `ds[i]` is batch i as a dict of arrays (every field, `source`
and `source_index` included). `iter_batches` shuffles batch order per epoch, splits batches
between ranks and reads ahead in threads so decompression overlaps the training step.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from batchctl.errors import BatchctlError, FormatError
from batchctl.store import format as fmt, storage

Batch = dict[str, np.ndarray]


class Dataset:
    """A batchctl dataset opened for reading."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        allow_partial: bool = False,
        storage_options: Mapping[str, object] | None = None,
    ) -> None:
        self.path = storage.normalise(path)
        self.storage_options = dict(storage_options or {})
        # a local dataset's folder is held open first: what is read next is of this version
        self._root = None if storage.is_url(self.path) else fmt.DatasetRoot(Path(self.path))
        try:
            self.group, self.attrs = fmt.open_group(self.path, allow_partial, self.storage_options)
            self.arrays = fmt.open_dataset_arrays(self.group, self.attrs, self.path)
            fmt.check_batch_sizes(self.arrays, self.attrs, self.path)
        except BatchctlError:
            raise
        except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError, RecursionError) as exc:
            # metadata of the wrong types, nested without end, or of impossible sizes: never a traceback
            raise FormatError(f"{self.path}: the metadata is damaged ({type(exc).__name__}: {exc})") from None
        self.batch_size = self.attrs.batch_size
        self.num_samples = self.attrs.num_samples if self.attrs.complete else self._rows_present()
        self.num_batches = fmt.num_batches(self.num_samples, self.batch_size)
        self.classes: list[str] | None = self.attrs.classes
        # shard files are read straight from a local disk; a URL, or a layout batchctl does not
        # write, is read through zarr (which reads a missing shard as fill values: checked first)
        self._fast = {
            name: fmt.ChunkReader.for_array(self._root, fmt.ArrayMeta.of_zarr(arr)) if self._root else None
            for name, arr in self.arrays.items()
        }
        self._present: set[tuple[str, int]] = set()

    def _rows_present(self) -> int:
        return min((arr.shape[0] for arr in self.arrays.values()), default=0)

    @property
    def fields(self) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]:
        """Field name -> (row shape, dtype), for every array including `source` (str) and `source_index`."""
        return {
            name: ((), np.dtype(np.str_)) if name == fmt.SOURCE else (tuple(arr.shape[1:]), np.dtype(arr.dtype))
            for name, arr in self.arrays.items()
        }

    def __len__(self) -> int:
        return self.num_batches

    def __getitem__(self, index: int) -> Batch:
        return {name: self.read_field(name, index) for name in self.arrays}

    def read_field(self, name: str, index: int) -> np.ndarray:
        """Batch `index` of one field alone."""
        if not isinstance(index, (int, np.integer)):
            raise TypeError(f"Expected a batch index (int), got {type(index).__name__} instead.")
        if index < 0:
            index += self.num_batches
        if not 0 <= index < self.num_batches:
            raise IndexError(f"batch {index} out of range: the dataset has {self.num_batches} batches")
        start = int(index) * self.batch_size
        stop = min(start + self.batch_size, self.num_samples)
        reader = self._fast[name]
        if reader is None:
            rows = self._read_zarr(name, self.arrays[name], start, stop)
        else:
            rows = reader.read(int(index))[: stop - start]
        return fmt.decode_sources(rows) if name == fmt.SOURCE else rows

    def _read_zarr(self, name: str, arr: Any, start: int, stop: int) -> np.ndarray:
        shard = start // int(arr.shards[0] if arr.shards else arr.chunks[0])
        if (name, shard) not in self._present:
            key = fmt.ArrayMeta.of_zarr(arr).shard_key(shard)
            fs, root = storage.locate(self.path, self.storage_options)
            if not fs.exists(f"{root}/{key}"):
                if self._root is not None:
                    self._root.check_current()
                raise FormatError(f"{self.path}: {name} shard {shard} is missing (no object {key})")
            self._present.add((name, shard))
        try:
            rows = np.asarray(arr[start:stop])
        except FormatError:
            raise
        except (RuntimeError, ValueError) as exc:  # what the decoders raise on bad bytes
            raise FormatError(f"{self.path}: {name} rows {start}-{stop}: corrupt data ({exc})") from exc
        if self._root is not None:
            self._root.check_current()  # zarr read by path: the rows must be of the opened version
        return rows

    def close(self) -> None:
        """Let go of the dataset's folder (garbage collection does it too)."""
        if self._root is not None:
            self._root.close()

    def __del__(self) -> None:
        root = getattr(self, "_root", None)
        if root is not None:
            root.close()

    def sample(self, index: int) -> dict[str, np.ndarray | str]:
        """Row `index` of every array (read through its batch, with the batch's checks)."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} out of range: the dataset has {self.num_samples} samples")
        batch, row = divmod(index, self.batch_size)
        return {name: column[row] for name, column in self[batch].items()}

    def batch_order(
        self, shuffle: bool = False, seed: int = 0, epoch: int = 0, rank: int = 0, world_size: int = 1
    ) -> list[int]:
        """Batch indices for one rank in one epoch.

        Shuffled deterministically from (seed, epoch). Ranks take disjoint, equally long slices:
        the last `num_batches % world_size` batches of the epoch's order are left out, so every
        rank runs the same number of steps (different ones each epoch when shuffled).
        """
        if world_size < 1 or not 0 <= rank < world_size:
            raise BatchctlError(f"Expected 0 <= rank < world_size, got rank {rank}, world_size {world_size} instead.")
        order = np.arange(self.num_batches)
        if shuffle:
            order = np.random.default_rng([seed, epoch]).permutation(self.num_batches)
        per_rank = self.num_batches // world_size
        return [int(i) for i in order[rank * per_rank : (rank + 1) * per_rank]] if world_size > 1 else order.tolist()

    def iter_batches(
        self,
        shuffle: bool = False,
        seed: int = 0,
        epoch: int = 0,
        rank: int = 0,
        world_size: int = 1,
        prefetch: int = 2,
    ) -> Iterator[Batch]:
        """Yield this rank's batches for one epoch, `prefetch` batches read ahead in threads."""
        return self.iter_order(self.batch_order(shuffle, seed, epoch, rank, world_size), prefetch)

    def iter_order(self, order: list[int], prefetch: int = 2) -> Iterator[Batch]:
        """Yield the batches `order` names, in that order, `prefetch` read ahead in threads."""
        if prefetch <= 0:
            yield from (self[i] for i in order)
            return
        # One thread per batch read ahead (up to the cores): preadv, crc32c and zstd release the GIL,
        # so one batch's read overlaps another's checksum or decoding and the caller's step. Side by
        # side on 2 cores, two threads read 0.9-1.2x of np.load's rate, one thread 0.45-0.7x;
        # benchmarks/read.py measures 84-90% of np.load with the default prefetch=2.
        threads = min(prefetch, len(os.sched_getaffinity(0)))  # prefetch >= 1 here
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="batchctl-read") as pool:
            pending: deque[Future[Batch]] = deque()
            indices = iter(order)
            for index in indices:
                pending.append(pool.submit(self.__getitem__, index))
                if len(pending) > prefetch:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()

    def __iter__(self) -> Iterator[Batch]:
        return self.iter_batches()

    def __repr__(self) -> str:
        return f"Dataset({self.path!r}, samples={self.num_samples}, batches={self.num_batches})"


def open(  # noqa: A001 - the public name
    path: str | os.PathLike[str], allow_partial: bool = False, storage_options: Mapping[str, object] | None = None
) -> Dataset:
    """Open a complete dataset, a local path or a URL (s3://...); `allow_partial=True` also opens
    one whose build did not finish. `storage_options` go to the URL's fsspec filesystem."""
    return Dataset(path, allow_partial=allow_partial, storage_options=storage_options)
