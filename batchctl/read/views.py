"""Views of a dataset that rewrite nothing: some of its fields (`FieldsOf`), some of its rows
(`Subset`: by class, by a glob on `source`, by a mask; `split_rows`: stable splits by a hash of
each file's path). A loader reads a view as it reads a dataset, and reads only what the view
needs: the arrays of its fields, the stored batches its rows are in."""

from __future__ import annotations

import fnmatch
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from batchctl.errors import UsageError
from batchctl.read.augment import Crop, crop_of
from batchctl.read.loader import Batch, BatchSource, Loader
from batchctl.store.metadata import LABEL, SOURCE

SPLIT_VERSION = 1  # the hash a split is drawn from: raise if it changes (every file's split would)


class Readable(BatchSource, Protocol):
    """What a view is made of: a `batchctl.Dataset`, or another view (what a loader reads, and more)."""

    num_batches: int
    classes: list[str] | None

    @property
    def arrays(self) -> Mapping[str, Any]: ...

    @property
    def storage_options(self) -> Mapping[str, object]: ...

    def check_cache_holds(self, prefetch: int) -> None: ...


class FieldsOf:
    """A dataset (or a subset) read for some of its fields only: nothing of the other arrays is read."""

    def __init__(self, base: Readable, fields: Sequence[str]) -> None:
        names = list(fields)
        unknown = [name for name in names if name not in base.fields]
        if isinstance(fields, str) or not names or unknown:
            raise UsageError(
                f"Expected fields to be a list of some of {', '.join(base.fields)}, got {fields!r} instead."
            )
        self.base, self.names = base, names
        self.path, self.build_id, self.remote = base.path, base.build_id, base.remote
        self.batch_size, self.num_samples = base.batch_size, base.num_samples
        self.selected, self.stored_rows = base.selected, base.stored_rows

    @property
    def fields(self) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]:
        every = self.base.fields
        return {name: every[name] for name in self.names}

    @property
    def encodings(self) -> dict[str, str]:
        return {name: kind for name, kind in self.base.encodings.items() if name in self.names}

    def __getitem__(self, index: int) -> Batch:
        return self.base.read_batch(index, fields=self.names)

    def read_batch(
        self, index: int, into: Mapping[str, list[np.ndarray]] | None = None, fields: list[str] | None = None
    ) -> Batch:
        chosen = [name for name in self.names if name not in (into or {})] if fields is None else fields
        return self.base.read_batch(index, into, chosen)


class Subset:
    """Some rows of a dataset (sorted row indices, `selected`). Its stored batches are the
    dataset's; a loader visits only those holding its rows and gives only its rows. A loader's
    resume state names the subset: a state of another one is refused."""

    def __init__(self, dataset: Readable, selected: np.ndarray) -> None:
        self.dataset, self.selected = dataset, np.asarray(selected, dtype=np.int64)
        self.path, self.build_id, self.remote = dataset.path, dataset.build_id, dataset.remote
        self.storage_options = dict(dataset.storage_options)  # what it was opened with
        self.batch_size, self.classes, self.arrays = dataset.batch_size, dataset.classes, dataset.arrays
        self.num_samples, self.stored_rows = len(self.selected), dataset.stored_rows
        self.num_batches = dataset.num_batches

    @property
    def fields(self) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]:
        return self.dataset.fields

    @property
    def encodings(self) -> dict[str, str]:
        return self.dataset.encodings

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> Batch:
        """Stored batch `index`, whole (a loader keeps the subset's rows of it)."""
        return self.dataset.read_batch(index)

    def read_batch(
        self, index: int, into: Mapping[str, list[np.ndarray]] | None = None, fields: list[str] | None = None
    ) -> Batch:
        return self.dataset.read_batch(index, into, fields)

    def check_cache_holds(self, prefetch: int) -> None:
        self.dataset.check_cache_holds(prefetch)

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
        """As `Dataset.loader`, over the subset's rows."""
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


def loader_of(
    base: Readable,
    batch_size: int | None,
    shuffle: bool,
    seed: int,
    mix: int,
    rank: int,
    world_size: int,
    drop_last: bool,
    prefetch: int | None,
    fields: Sequence[str] | None,
    partitions: int | None = None,
    ragged: str = "list",
    crop: Crop | None = None,
) -> Loader:
    """The loader of a dataset or a subset (`Dataset.loader`, `Subset.loader`): over its rows, read
    for `fields` only when given, refused when its cache cannot hold what the loader reads ahead."""
    source = base if fields is None else FieldsOf(base, fields)
    loader = Loader(
        source, batch_size, shuffle, seed, mix, rank, world_size, drop_last, prefetch, partitions, ragged, crop
    )
    base.check_cache_holds(loader.prefetch)
    return loader


def column(dataset: Readable, name: str) -> np.ndarray:
    """Every row of one (small) array: `label` or `source`, read batch by batch."""
    parts = [dataset.read_batch(index, fields=[name])[name] for index in range(dataset.num_batches)]
    return np.concatenate(parts) if parts else np.empty(0)


def select_rows(dataset: Readable, labels: Sequence[int | str] | None, source: Any, rows: Any) -> np.ndarray:
    """The sorted rows matching every criterion given (all rows when none is)."""
    keep = np.ones(dataset.num_samples, dtype=bool)
    if labels is not None:
        if LABEL not in dataset.arrays or dataset.classes is None:
            raise UsageError(f"{dataset.path} has no classes: a subset by labels needs class folders")
        wanted = [_label_number(label, dataset.classes) for label in labels]
        keep &= np.isin(column(dataset, LABEL), wanted)
    if source is not None:
        globs = [source] if isinstance(source, str) else list(source)
        paths = column(dataset, SOURCE)
        keep &= np.array([any(fnmatch.fnmatchcase(str(path), glob) for glob in globs) for path in paths], dtype=bool)
    if rows is not None:
        keep &= _row_mask(rows, dataset.num_samples)
    return np.flatnonzero(keep)


def _label_number(label: int | str, classes: list[str]) -> int:
    if isinstance(label, str) and label in classes:
        return classes.index(label)
    if isinstance(label, (int, np.integer)) and not isinstance(label, bool) and 0 <= label < len(classes):
        return int(label)
    raise UsageError(f"Expected labels among {classes} (or 0 to {len(classes) - 1}), got {label!r} instead.")


def _row_mask(rows: Any, count: int) -> np.ndarray:
    found = np.asarray(rows)
    if found.dtype == bool:
        if found.shape != (count,):
            raise UsageError(f"Expected a mask of {count} booleans, got one of shape {found.shape} instead.")
        return found
    if found.ndim != 1 or found.dtype.kind not in "iu" or (len(found) and not 0 <= found.min() <= found.max() < count):
        raise UsageError(f"Expected row indices from 0 to {count - 1} (or a boolean mask), got {rows!r} instead.")
    mask = np.zeros(count, dtype=bool)
    mask[found] = True
    return mask


def split_rows(dataset: Readable, fractions: Mapping[str, float], seed: int) -> dict[str, np.ndarray]:
    """Each file's rows go to one split, by where a hash of (seed, its `source` path) falls among
    the cumulative fractions: a file keeps its split whatever else the folder holds."""
    names = list(fractions)
    values = [fractions[name] for name in names]
    numbers = all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) for v in values)
    shares = np.array(values if numbers else [], dtype=float)
    if not names or not numbers or not np.isfinite(shares).all() or (shares < 0).any() or shares.sum() > 1 + 1e-9:
        raise UsageError(
            f"Expected fractions (numbers >= 0) that add up to at most 1, got {dict(fractions)!r} instead."
        )
    edges = np.cumsum(shares)
    paths = column(dataset, SOURCE)
    where = np.array([_unit_hash(seed, str(path)) for path in paths], dtype=float)
    which = np.searchsorted(edges, where, side="right")  # len(names): in no split (the fractions leave a rest)
    return {name: np.flatnonzero(which == k) for k, name in enumerate(names)}


def _unit_hash(seed: int, path: str) -> float:
    """A number in [0, 1) drawn from (seed, path) alone."""
    digest = hashlib.sha256(f"batchctl split {SPLIT_VERSION}\0{seed}\0{path}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64
