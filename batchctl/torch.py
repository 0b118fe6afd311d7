"""PyTorch adapters (optional: needs `pip install batchctl[torch]`).

`BatchDataset` is map-style over whole batches, for `DataLoader(ds, batch_size=None,
num_workers=k)`; `IterableBatches` shuffles per epoch and splits batches between
`torch.distributed` ranks and DataLoader workers. Numeric fields become tensors; `source` stays a
list of strings.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset as TorchDataset, IterableDataset, get_worker_info

from batchctl.read.reader import Batch, Dataset


def to_torch(batch: Batch) -> dict[str, Any]:
    return {
        name: [str(s) for s in values] if values.dtype.kind in "TUO" else torch.from_numpy(np.ascontiguousarray(values))
        for name, values in batch.items()
    }


class _Lazy:
    """The dataset, opened here to learn its length and opened again in each process it is
    pickled to (DataLoader workers each get their own)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._ds: Dataset | None = None
        self.num_batches = len(self.dataset)

    @property
    def dataset(self) -> Dataset:
        if self._ds is None:
            self._ds = Dataset(self.path)
        return self._ds

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "_ds": None, "num_batches": self.num_batches}


class BatchDataset(TorchDataset[dict[str, Any]]):
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._lazy = _Lazy(path)

    def __len__(self) -> int:
        return self._lazy.num_batches

    def __getitem__(self, index: int) -> dict[str, Any]:
        return to_torch(self._lazy.dataset[index])


class IterableBatches(IterableDataset[dict[str, Any]]):
    """Each rank reads a disjoint, equally long share of the epoch's batches (as DDP needs), and
    the DataLoader workers of a rank split that share between them, none left out."""

    def __init__(self, path: str | os.PathLike[str], shuffle: bool = True, seed: int = 0, prefetch: int = 2) -> None:
        self._lazy = _Lazy(path)
        self.shuffle, self.seed, self.prefetch, self.epoch = shuffle, seed, prefetch, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _order(self) -> list[int]:
        rank, world = (
            (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
        )
        order = self._lazy.dataset.batch_order(self.shuffle, self.seed, self.epoch, rank, world)
        worker = get_worker_info()
        return order if worker is None else order[worker.id :: worker.num_workers]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self._lazy.dataset.iter_order(self._order(), self.prefetch):
            yield to_torch(batch)
