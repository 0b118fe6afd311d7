"""Read: a built dataset as batches of NumPy arrays, with no framework dependency.

`open(path)` returns a `Dataset`; `ds[i]` is stored batch i as a dict of arrays (every field,
`source` and `source_index` included). `ds.loader(...)` is the way to train from it
(`batchctl/read/loader.py`): any batch size, fresh batches each epoch, ranks, resume.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from batchctl.errors import BatchctlError, FormatError
from batchctl.read.loader import Batch, Loader
from batchctl.store import format as fmt, storage

__all__ = ["Batch", "Dataset", "open"]


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
        self.build_id = self.attrs.build_id  # the version: a loader's resume state names it
        self.num_samples = self.attrs.num_samples if self.attrs.complete else self._rows_present()
        self.num_batches = fmt.num_batches(self.num_samples, self.batch_size)
        self.classes: list[str] | None = self.attrs.classes
        # batches are read straight from the shard files: a local one's by pread, an object's by
        # one ranged read each; a layout batchctl does not write is read through zarr (which reads
        # a missing shard as fill values: checked first)
        self.remote = self._root is None
        self._fast = self._chunk_readers()
        self._present: set[tuple[str, int]] = set()

    def _chunk_readers(self) -> dict[str, fmt.ChunkReader | fmt.RemoteChunkReader | None]:
        metas = {name: fmt.ArrayMeta.of_zarr(arr) for name, arr in self.arrays.items()}
        if self._root is not None:
            return {name: fmt.ChunkReader.for_array(self._root, meta) for name, meta in metas.items()}
        fs, root = storage.locate(self.path, self.storage_options)
        return {name: fmt.RemoteChunkReader.for_array(fs, root, meta) for name, meta in metas.items()}

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
        index, start, stop = self._rows_of(index)
        reader = self._fast[name]
        if reader is None:
            rows = self._read_zarr(name, self.arrays[name], start, stop)
        else:
            rows = reader.read(int(index))[: stop - start]
        return fmt.decode_sources(rows) if name == fmt.SOURCE else rows

    def read_rows(self, name: str, index: int, rows: list[np.ndarray]) -> None:
        """Batch `index` of a numeric field, row i into `rows[i]` (one C-contiguous buffer per row
        of a whole stored batch, rows past the dataset's end included): the loader's shuffles
        put each row in its output batch as it is read, with no copy from a local shard file."""
        index, start, stop = self._rows_of(index)
        reader = self._fast[name]
        if name == fmt.SOURCE or len(rows) != self.batch_size:
            raise ValueError(f"expected {self.batch_size} row buffers of a numeric field, got {len(rows)} of {name}")
        if reader is not None:
            reader.read_rows(int(index), rows)
            return
        for row, values in zip(rows, self._read_zarr(name, self.arrays[name], start, stop), strict=False):
            row[...] = values

    def _rows_of(self, index: int) -> tuple[int, int, int]:
        """The batch index (a negative one counted from the end) and its rows' range."""
        if not isinstance(index, (int, np.integer)):
            raise TypeError(f"Expected a batch index (int), got {type(index).__name__} instead.")
        if index < 0:
            index += self.num_batches
        if not 0 <= index < self.num_batches:
            raise IndexError(f"batch {index} out of range: the dataset has {self.num_batches} batches")
        start = int(index) * self.batch_size
        return int(index), start, min(start + self.batch_size, self.num_samples)

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

    def loader(
        self,
        batch_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        mix: int = 16,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
        prefetch: int | None = None,
    ) -> Loader:
        """Batches for training: any `batch_size` (default: the stored one), fresh batches every
        epoch (`mix` stored batches' rows permuted together), one order for any number of ranks,
        and a resume state (`state_dict`) that continues exactly, on this or another world size.
        `prefetch` stored batches are read ahead (default: one group of `mix`). See `Loader`."""
        return Loader(self, batch_size, shuffle, seed, mix, rank, world_size, drop_last, prefetch)

    def iter_batches(
        self,
        shuffle: bool = False,
        seed: int = 0,
        epoch: int = 0,
        rank: int = 0,
        world_size: int = 1,
        prefetch: int = 2,
    ) -> Iterator[Batch]:
        """The stored batches of one epoch, whole (`loader(mix=1)`): in stored order, or
        shuffled per (seed, epoch). One rank keeps the short last batch; several take equal
        shares, leaving out what cannot be shared evenly."""
        loader = self.loader(None, shuffle, seed, 1, rank, world_size, drop_last=world_size > 1, prefetch=prefetch)
        loader.set_epoch(epoch)
        return iter(loader)

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
