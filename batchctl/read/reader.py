"""Read: a built dataset as batches of NumPy arrays, with no framework dependency.

`open(path)` returns a `Dataset`; `ds[i]` is stored batch i as a dict of arrays (every field,
`source` and `source_index` included). `ds.loader(...)` is the way to train from it
(`batchctl/read/loader.py`): any batch size, fresh batches each epoch, ranks, resume.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np

from batchctl.errors import BatchctlError, FormatError, UsageError
from batchctl.read.augment import crop_of
from batchctl.read.budget import BudgetLoader
from batchctl.read.loader import Batch, Loader
from batchctl.read.packing import PackedLoader
from batchctl.read.views import Subset, loader_of, select_rows, split_rows
from batchctl.report import size_text
from batchctl.store import chunkread, codec, format as fmt, metadata, ragged as ragged_rows, storage, zarrmeta
from batchctl.store.cache import ChunkCache
from batchctl.store.metadata import values_array
from batchctl.store.remote import RETRY_FOR_S, RemoteChunkReader, RemoteStore, RemoteValuesReader

__all__ = ["Batch", "Dataset", "open"]


class Dataset:
    """A batchctl dataset opened for reading."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        allow_partial: bool = False,
        storage_options: Mapping[str, object] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | str | None = None,
        retry_for: float = RETRY_FOR_S,
    ) -> None:
        self.path = storage.normalise(path)
        self.storage_options = dict(storage_options or {})
        if (cache_dir is not None or cache_limit is not None) and not storage.is_url(self.path):
            raise UsageError(f"cache_dir and cache_limit are for a dataset at a URL; {self.path} is on local disk")
        if cache_limit is not None and cache_dir is None:
            raise UsageError("cache_limit needs cache_dir: the folder the cache is kept in")
        # a local dataset's folder is held open first: what is read next is of this version
        self._root = None if storage.is_url(self.path) else chunkread.DatasetRoot(Path(self.path))
        if self._root is None:
            _check_reachable(self.path, self.storage_options)
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
        self.num_batches = metadata.num_batches(self.num_samples, self.batch_size)
        self.selected: np.ndarray | None = None  # every row (a `Subset` names some)
        self.stored_rows = self.num_samples
        self.classes: list[str] | None = self.attrs.classes
        # batches are read straight from the shard files: a local one's by pread, an object's by
        # one ranged read each; a layout batchctl does not write is read through zarr (which reads
        # a missing shard as fill values: checked first)
        self.remote = self._root is None
        self._store = self._remote_store(cache_dir, cache_limit, retry_for) if self.remote else None
        self._fast = self._chunk_readers()
        # ragged fields (docs/format.md): read as offsets, then the batch's values
        self.ragged = {name: spec for name, spec in self.attrs.schema.items() if spec.ragged and self.arrays}
        # text fields (a table's text columns) and `source`: rows of UTF-8 bytes, read as str
        self.texts = {name for name, arr in self.arrays.items() if name == metadata.SOURCE or metadata.is_text(arr)}
        self._values = {name: self._values_reader(name) for name in self.ragged}
        self._present: set[tuple[str, int]] = set()

    def _values_reader(self, name: str) -> chunkread.BatchValues | None:
        """A ragged field's values are read by batchctl, from a file or a URL; a layout batchctl
        does not write through zarr."""
        meta = zarrmeta.ArrayMeta.of_zarr(self.arrays[values_array(name)])
        if self._root is None:
            assert self._store is not None
            return RemoteValuesReader.for_array(self._store, meta)
        return chunkread.ValuesReader.for_array(self._root, meta)

    def _remote_store(self, cache_dir: Any, cache_limit: int | str | None, retry_for: float) -> RemoteStore:
        """The objects of this version; cached only when complete (a partial one still grows)."""
        cache = None
        if cache_dir is not None and self.attrs.complete:
            cache = ChunkCache(cache_dir, cache_limit, self.path, self.build_id)
        return RemoteStore(self.path, self.storage_options, cache, retry_for)

    def _chunk_readers(self) -> dict[str, chunkread.ChunkReader | RemoteChunkReader | None]:
        metas = {name: zarrmeta.ArrayMeta.of_zarr(arr) for name, arr in self.arrays.items()}
        if self._root is not None:
            return {name: chunkread.ChunkReader.for_array(self._root, meta) for name, meta in metas.items()}
        assert self._store is not None
        return {name: RemoteChunkReader.for_array(self._store, meta) for name, meta in metas.items()}

    @property
    def cache(self) -> ChunkCache | None:
        """The local cache of a dataset at a URL opened with `cache_dir`."""
        return None if self._store is None else self._store.cache

    def stored_batch_bytes(self) -> int:
        """About how many bytes one stored batch takes in the store, all fields: the mean over
        the first shard (from its indexes; a layout not batchctl's counts its raw size)."""
        remote = [reader for reader in self._fast.values() if isinstance(reader, RemoteChunkReader)]
        if self._store is not None and remote and self.num_batches:
            self._store.load_indexes(0, remote)
        total = 0
        for name, reader in self._fast.items():
            if isinstance(reader, RemoteChunkReader) and self.num_batches:
                sizes = reader.indexes[0][:, 1]
                present = sizes[reader.indexes[0][:, 0] != codec.NO_CHUNK]
                total += int(present.mean()) if len(present) else 0
            else:
                arr = self.arrays[name]
                total += int(np.prod(arr.chunks)) * np.dtype(arr.dtype).itemsize
        return total

    @property
    def encodings(self) -> dict[str, str]:
        """Ragged fields of encoded bytes and their media type (`image/jpeg`), as their values'
        `encoding` attribute says (`--store jpeg`)."""
        found = {}
        for name in self.ragged:
            encoding = self.arrays[values_array(name)].attrs.get("encoding")
            if isinstance(encoding, str):
                found[name] = encoding
        return found

    def _rows_present(self) -> int:
        return min((arr.shape[0] for arr in self.arrays.values()), default=0)

    @property
    def fields(self) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]:
        """Field name -> (row shape, dtype), for every field including `source` (str) and
        `source_index`; a ragged field's row shape starts with -1 (its rows vary in length)."""
        found: dict[str, tuple[tuple[int, ...], np.dtype[Any]]] = {}
        for name, arr in self.arrays.items():
            field_name, part = metadata.ragged_part(name)
            if part == metadata.VALUES_SUFFIX:
                found[field_name] = ((-1, *self.ragged[field_name].shape), np.dtype(arr.dtype))
            elif name in self.texts:
                found[name] = ((), np.dtype(np.str_))
            elif not part:
                found[name] = (tuple(arr.shape[1:]), np.dtype(arr.dtype))
        return found

    def __len__(self) -> int:
        return self.num_batches

    def __getitem__(self, index: int) -> Batch:
        return self.read_batch(index)

    def ragged_batch(self, name: str, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Stored batch `index` of ragged field `name` as it is stored: its rows' `[start, stop)`
        and their values end to end (no array per row: what packs many small rows together)."""
        offsets = np.asarray(
            self.read_batch(index, fields=[metadata.offsets_array(name)])[metadata.offsets_array(name)]
        )
        where = f"{self.path}: {name} batch {index}"
        values = chunkread.batch_values(self._values[name], self.arrays[values_array(name)], index, offsets, where)
        end = int(offsets[:, 1].max()) if len(offsets) else 0
        return offsets, values[:end]

    def read_field(self, name: str, index: int) -> np.ndarray:
        """Batch `index` of one field alone."""
        return self.read_batch(index, fields=[name])[name]

    def read_batch(
        self, index: int, into: Mapping[str, list[np.ndarray]] | None = None, fields: list[str] | None = None
    ) -> Batch:
        """Stored batch `index`: numeric fields named in `into` read row i into `into[name][i]`
        (one C-contiguous buffer per row of a whole stored batch, rows past the dataset's end
        included: the loader's shuffles put each row in its output batch as it is read, with no
        copy from a local shard file), and `fields` (default: every other one) returned. From a
        URL every field's bytes are fetched together."""
        index, start, stop = self._rows_of(index)
        into = dict(into or {})
        for name, rows in into.items():
            if name in self.texts or len(rows) != self.batch_size:
                raise ValueError(f"expected {self.batch_size} row buffers of numeric {name}, got {len(rows)}")
        names = [name for name in self.fields if name not in into] if fields is None else fields
        ragged = [name for name in names if name in self.ragged]
        arrays = [name for name in names if name not in self.ragged] + [metadata.offsets_array(n) for n in ragged]
        whole = {name: self._chunk_buffer(name) for name in arrays if self._fast.get(name) is not None}
        self._read_chunks(index, {**into, **{name: [buffer] for name, buffer in whole.items()}})
        out: Batch = {}
        for name in arrays:
            values = whole[name][: stop - start] if name in whole else self._read_zarr(name, start, stop)
            out[name] = fmt.decode_sources(values) if name in self.texts else values
        for name in ragged:
            offsets = out[metadata.offsets_array(name)]
            where = f"{self.path}: {name} batch {index}"
            values = chunkread.batch_values(self._values[name], self.arrays[values_array(name)], index, offsets, where)
            out[name] = ragged_rows.rows_of(offsets, values, where)
        out = {name: out[name] for name in names}
        for name, buffers in into.items():
            if self._fast[name] is None:
                for buffer, values in zip(buffers, self._read_zarr(name, start, stop), strict=False):
                    buffer[...] = values
        return out

    def _read_chunks(self, index: int, targets: Mapping[str, list[np.ndarray]]) -> None:
        """Chunk `index` of the fields read by batchctl's own readers into their buffers."""
        fast = {name: rows for name, rows in targets.items() if self._fast[name] is not None}
        if self._store is not None:
            if fast:
                self._store.read_chunks(index, [(cast(RemoteChunkReader, self._fast[n]), r) for n, r in fast.items()])
            return
        for name, rows in fast.items():
            cast(chunkread.ChunkReader, self._fast[name]).read_rows(index, rows)

    def _chunk_buffer(self, name: str) -> np.ndarray:
        arr = self.arrays[name]
        return np.empty(tuple(int(n) for n in arr.chunks), arr.dtype)

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

    def _read_zarr(self, name: str, start: int, stop: int) -> np.ndarray:
        arr = self.arrays[name]
        shard = start // int(arr.shards[0] if arr.shards else arr.chunks[0])
        if (name, shard) not in self._present:
            key = zarrmeta.ArrayMeta.of_zarr(arr).shard_key(shard)
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

    def packed(
        self,
        block: int,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        mix: int = 16,
        rank: int = 0,
        world_size: int = 1,
        field: str = "tokens",
        rows: bool = False,
    ) -> PackedLoader:
        """Batches of `batch_size` blocks of `block` tokens of a ragged token field (`--preprocess
        text`'s `tokens`), cut from the documents laid end to end in an order that changes every
        epoch: `tokens` and `positions` (each token's place in its document), `rows` (its
        document's row) with `rows=True`. See `read/packing.py`."""
        return PackedLoader(self, block, batch_size, seed, shuffle, mix, rank, world_size, field, rows)

    def budgeted(
        self,
        max_tokens: int,
        padded: bool = False,
        window: int = 16,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        field: str = "tokens",
        truncate: bool = False,
    ) -> BudgetLoader:
        """Batches of whole rows of a ragged token field, as many as fit under `max_tokens` (their
        tokens, or with `padded=True` rows x the longest), rows of like length together: `tokens`
        zero-padded, `tokens_lengths`, `rows`. See `read/budget.py`."""
        return BudgetLoader(self, max_tokens, padded, window, seed, shuffle, rank, world_size, field, truncate)

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
        fields: Sequence[str] | None = None,
        partitions: int | None = None,
        ragged: str = "list",
        random_resized_crop: int | None = None,
        center_crop: int | None = None,
        flip: bool = False,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
    ) -> Loader:
        """Batches for training: any `batch_size` (default: the stored one), fresh batches every
        epoch (`mix` stored batches' rows permuted together), each stored batch read by one rank
        only, and a resume state (`state_dict`) that continues exactly, on this or another world
        size dividing `partitions` (default: `world_size`; say 12 to resume on 1, 2, 3, 4, 6 or
        12 ranks). `prefetch` stored batches are read ahead (default: two groups of `mix`; one from a URL).
        `fields`: only these arrays are read (nothing of the others); the order and resume state
        are the same whatever fields are read. A ragged field comes as a list of each row's array
        (`ragged="list"`) or zero-padded to the batch's longest row with `NAME_lengths` beside it
        (`ragged="pad"`). An encoded image field (`--store jpeg`) is decoded as it is read: into
        `random_resized_crop` x `random_resized_crop` RGB crops as torchvision's RandomResizedCrop
        takes them (`scale`, `ratio`; a horizontal flip half the time with `flip=True`), or a
        centre crop (`center_crop`: Resize(size / 0.875) + CenterCrop(size)); each row's draws
        depend on (seed, epoch, row) only, so a resume gives the same crops. See `Loader`,
        `read/order.py` and `read/augment.py`."""
        crop = crop_of(random_resized_crop, center_crop, flip, scale, ratio)
        return loader_of(
            self,
            batch_size,
            shuffle,
            seed,
            mix,
            rank,
            world_size,
            drop_last,
            prefetch,
            fields,
            partitions,
            ragged,
            crop,
        )

    def subset(
        self,
        labels: Sequence[int | str] | None = None,
        source: str | Sequence[str] | None = None,
        rows: Any = None,
    ) -> Subset:
        """Some rows of the dataset, without rewriting anything: those of the classes `labels`
        (names or numbers), and/or whose `source` matches a glob (or any of several), and/or
        `rows` (a boolean mask over every row, or row indices). A view `loader`,
        `IterableBatches` and `split` take; its loader reads only the stored batches its rows are in."""
        return Subset(self, select_rows(self, labels, source, rows))

    def split(self, fractions: Mapping[str, float], seed: int = 0) -> dict[str, Subset]:
        """Stable splits by name (`{"train": 0.9, "val": 0.1}`): each file goes to a split by a hash
        of its `source` path and `seed`, so it stays in its split when the folder grows, files are
        removed, or the dataset is rebuilt or updated. Fractions hold within sampling noise."""
        return {name: Subset(self, found) for name, found in split_rows(self, fractions, seed).items()}

    def check_cache_holds(self, prefetch: int) -> None:
        """Refuse a cache too small for the stored batches a loader reads ahead: each would push
        out the one before it is used, and the cache would only cost."""
        cache = self.cache
        if cache is None or not prefetch:
            return
        each = self.stored_batch_bytes()
        if cache.limit < prefetch * each:
            raise UsageError(
                f"cache_limit {size_text(cache.limit)} holds fewer than the {prefetch} stored batches the loader reads "
                f"ahead (prefetch={prefetch}, about {size_text(each)} each): raise cache_limit or lower prefetch"
            )

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


def _check_reachable(url: str, storage_options: Mapping[str, object]) -> None:
    """Read the group's document through batchctl's own store calls first: an unreachable store,
    missing credentials or a refusal is one `StoreError` line naming the store (zarr-python's
    concurrent probes would print every client's traceback), a missing one a `FormatError`."""
    try:
        zarrmeta.DatasetFiles(url, storage_options).read(zarrmeta.ZARR_JSON)
    except FileNotFoundError:
        raise FormatError(f"{url}: no batchctl dataset here (no zarr.json; `batchctl build` makes one).") from None
    except storage.StoreError as error:
        raise storage.StoreError(
            errno.EIO,
            f"cannot open {url}: {error.strerror}; check the URL, the network and storage_options "
            "(endpoint_url, credentials)",
        ) from None


def open(  # noqa: A001 - the public name
    path: str | os.PathLike[str],
    allow_partial: bool = False,
    storage_options: Mapping[str, object] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit: int | str | None = None,
    retry_for: float = RETRY_FOR_S,
) -> Dataset:
    """Open a complete dataset, a local path or a URL (s3://...); `allow_partial=True` also opens
    one whose build did not finish. `storage_options` go to the URL's fsspec filesystem.

    From a URL, `cache_dir` keeps what is read on local disk, at most `cache_limit` bytes (an int
    or a size such as "20GB"; default half the disk's free space) in that folder, however many
    processes share it: later epochs read it from there. A read failing for a passing reason is
    retried for `retry_for` seconds before it ends the epoch with one error."""
    return Dataset(path, allow_partial, storage_options, cache_dir, cache_limit, retry_for)
