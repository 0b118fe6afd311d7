"""PyTorch adapters (optional: needs `pip install batchctl[torch]`).

`IterableBatches` is the training stream: `Dataset.loader`'s order (any batch size, fresh batches
every epoch, one order for any number of ranks) for a `DataLoader(stream, batch_size=None)`, its
rank and world size taken from `torch.distributed`, a rank's share split between the DataLoader's
workers, and a resume state for torchdata's `StatefulDataLoader`. `BatchDataset` is map-style over
the stored batches. Numeric fields become tensors; `source` stays a list of strings; a ragged field's rows become
one nested tensor (`to_torch`).
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.sharedctypes import RawArray, RawValue
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset as TorchDataset, IterableDataset, get_worker_info

from batchctl.errors import ResumeMismatchError, UsageError
from batchctl.read.loader import Loader
from batchctl.read.mixture import MixedLoader
from batchctl.read.reader import Dataset
from batchctl.read.views import FieldsOf, Subset
from batchctl.run.mpinternals import pickled_for_a_child
from batchctl.torch_ring import BatchRing, SharedLock, SlotBatch, slot_bytes
from batchctl.torch_state import finished, rank_steps, saved_num_workers, stream_states

# torchdata 0.11's StatefulDataLoader calls a function torch 2.13 deprecates, on every iterator it
# makes: a warning the user can do nothing about, in every run of a recipe (one message, no other)
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)


def to_torch(batch: Mapping[str, Any]) -> dict[str, Any]:
    """Numeric fields as tensors, `source` as a list of str, and a ragged field's rows (a list,
    or an object array, of arrays) as one nested tensor (`layout=torch.jagged`: `.unbind()`
    gives the rows, `.to_padded_tensor(0)` pads them)."""
    out: dict[str, Any] = {}
    for name, values in batch.items():
        if isinstance(values, list) or (values.dtype == object and len(values) and isinstance(values[0], np.ndarray)):
            rows = [torch.from_numpy(np.ascontiguousarray(row)) for row in values]
            out[name] = torch.nested.nested_tensor(rows, layout=torch.jagged)
        elif values.dtype.kind in "TUO":
            out[name] = [str(s) for s in values]
        else:
            out[name] = torch.from_numpy(np.ascontiguousarray(values))
    return out


class _Lazy:
    """The dataset, opened here to learn its length and opened again in each process it is
    pickled to (DataLoader workers each get their own)."""

    def __init__(self, path: str | os.PathLike[str], **open_options: Any) -> None:
        self.path = os.fspath(path)
        self.open_options = open_options  # storage_options, cache_dir, cache_limit: see `batchctl.open`
        self._ds: Dataset | None = None
        self.num_batches = len(self.dataset)

    @property
    def dataset(self) -> Dataset:
        if self._ds is None:
            self._ds = Dataset(self.path, **self.open_options)
        return self._ds

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_ds": None}


class BatchDataset(TorchDataset[dict[str, Any]]):
    """Stored batch i, for `DataLoader(ds, batch_size=None, shuffle=True, num_workers=k)`."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        storage_options: Mapping[str, object] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | str | None = None,
        fields: Sequence[str] | None = None,
    ) -> None:
        self._lazy = _Lazy(path, storage_options=storage_options, cache_dir=cache_dir, cache_limit=cache_limit)
        self.fields = None if fields is None else FieldsOf(self._lazy.dataset, fields).names  # checked here

    def __len__(self) -> int:
        return self._lazy.num_batches

    def __getitem__(self, index: int) -> dict[str, Any]:
        return to_torch(self._lazy.dataset.read_batch(index, fields=self.fields))


@functools.cache
def _stateful_loader_class() -> type:
    """`StatefulDataLoader` with the check of a state's workers (torchdata is optional: imported here)."""
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        raise UsageError("IterableBatches.dataloader needs torchdata: pip install torchdata") from None

    class BatchctlDataLoader(StatefulDataLoader):  # type: ignore[misc]
        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            """The state as torchdata loads it, saved with these `num_workers` on this world size;
            else the rank's place in it, taken up by the stream itself, the DataLoader starting
            afresh from there (torchdata's own layout holds one place per worker)."""
            stream, saved = self.dataset, saved_num_workers(state_dict)
            if (
                saved is None
                or not isinstance(stream, IterableBatches)
                or not stream.layout_differs(state_dict, saved, self.num_workers)
            ):
                super().load_state_dict(state_dict)
                return
            rank = stream.rank_state(state_dict)
            if rank is None:
                raise ResumeMismatchError(
                    f"the state was saved by a DataLoader with num_workers={saved}, this one has "
                    f"num_workers={self.num_workers}, and the state does not say where its rank was: "
                    f"resume with num_workers={saved}"
                )
            stream.load_state_dict(rank)
            stream.any_workers()

    return BatchctlDataLoader


@dataclass
class _Pass:
    """One process's pass over an epoch: where it began (a global position), the steps it has
    handed out, and the shared epoch when it was taken up (a `set_epoch` since then replaces it)."""

    epoch: int
    seen: int
    start: int = 0
    yielded: int = 0


def _rank_and_world_size(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """As given; else `torch.distributed`'s, when a process group is initialised; else torchrun's
    environment (RANK, WORLD_SIZE), so that ranks started by torchrun before (or without) a
    process group do not each read the whole epoch; else one rank."""
    if dist.is_available() and dist.is_initialized():
        found = (dist.get_rank(), dist.get_world_size())
    else:
        found = (_environment_int("RANK", 0), _environment_int("WORLD_SIZE", 1))
    return (found[0] if rank is None else rank, found[1] if world_size is None else world_size)


def _environment_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"the environment's {name}={value!r} is not a number (torchrun sets it)") from None


class IterableBatches(IterableDataset[dict[str, Any]]):
    """This rank's batches of `Dataset.loader`'s order, epoch after epoch.

    Rank and world size come from `torch.distributed` when it is initialised as this is made
    (DataLoader workers cannot ask it), else from torchrun's environment (RANK, WORLD_SIZE),
    unless given. DataLoader worker w of n takes its rank's
    steps w, w+n, ...: the DataLoader hands them out in turn, so the rank sees the loader's order
    whatever n is. Handing out an epoch's last batch moves to the next epoch, and `set_epoch`
    picks one; the epoch lives in a few bytes of memory shared with the DataLoader's workers, so
    both reach them whether the workers are kept (`persistent_workers=True`) or made each epoch.
    `state_dict`/`load_state_dict` make it resumable under torchdata's `StatefulDataLoader`.
    `path` may be a `Subset` (`ds.subset(...)`, `ds.split(...)[name]`): its rows are read, the
    dataset opened again in each worker (it must still be the version the subset was made of); or
    a mixture (`batchctl.mix(...)`): its sources are opened again in each worker and its own
    options used (the ones here other than rank, world size, cache and partitions are not).
    A ragged field comes as a nested tensor (`ragged="list"`: `torch.jagged` layout) or padded
    with `NAME_lengths` beside it (`ragged="pad"`); an encoded image field is decoded and cropped
    in the DataLoader's workers (`random_resized_crop`, `center_crop`, `flip`: `Dataset.loader`).
    `transform(batch) -> batch` runs on each batch where it is made (in the DataLoader's
    workers): a CPU augmentation, whose new tensors cross in a shared slot too.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Subset | MixedLoader,
        batch_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        mix: int = 16,
        drop_last: bool = True,
        prefetch: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        storage_options: Mapping[str, object] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | str | None = None,
        fields: Sequence[str] | None = None,
        partitions: int | None = None,
        ragged: str = "list",
        random_resized_crop: int | None = None,
        center_crop: int | None = None,
        flip: bool = False,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> None:
        self._rows: tuple[str, np.ndarray] | None = None  # a subset's: (its dataset's version, its rows)
        self.transform = transform  # each batch's, where it is made (an augmentation): picklable
        # a mixture's sources and options (`MixedLoader.recipe`), made again in each process
        self._recipe: dict[str, Any] | None = None
        self._cache: tuple[str | os.PathLike[str] | None, int | str | None] = (cache_dir, cache_limit)
        self._lazy: _Lazy | None = None
        if isinstance(path, MixedLoader):
            self._recipe = path.recipe()
            partitions = self._recipe["options"]["partitions"] if partitions is None else partitions
        else:
            if isinstance(path, Subset):
                self._rows = (path.build_id, path.selected)
                storage_options = storage_options if storage_options is not None else path.storage_options
                path = path.path
            self._lazy = _Lazy(path, storage_options=storage_options, cache_dir=cache_dir, cache_limit=cache_limit)
        self.rank, self.world_size = _rank_and_world_size(rank, world_size)
        self._options: dict[str, Any] = {"batch_size": batch_size, "shuffle": shuffle, "seed": seed, "mix": mix}
        self._options.update(drop_last=drop_last, prefetch=prefetch, fields=fields, ragged=ragged)
        if random_resized_crop is not None or center_crop is not None:  # encoded images, decoded in the workers
            self._options.update(random_resized_crop=random_resized_crop, center_crop=center_crop, flip=flip)
            self._options.update(scale=scale, ratio=ratio)
        # the order's partitions: given, else a loaded state's, else one per rank x worker of the first pass
        self._options.update(partitions=partitions)
        self._partitions = partitions
        self._loader_made: Loader | MixedLoader | None = None
        made = self._loader()  # options checked here, not first in a DataLoader worker
        # DataLoader workers hand their batches over in shared slots (`torch_ring`), made here, before them
        rows = made.options.batch_size  # (a loader's and a mixture's)
        self._ring = BatchRing.create(slot_bytes(rows, made.output_fields()))
        self._epoch: Any = RawValue("q", 0)  # shared with DataLoader workers (inherited, or passed as they start)
        self._workers_said: Any = RawValue("q", 0)  # the partitions the workers' first pass fixed (0: none yet)
        # the DataLoader pass (see `_pass_key`) whose first worker to finish moved the epoch on, and from which:
        # a worker of that same pass starting later still takes its share of that epoch
        self._advanced: Any = RawArray("q", [-1, -1, -1])
        self._advancing = SharedLock()  # held while `_advanced` is read or set
        self._pass_key: tuple[int, int] | None = None
        self._passes = 0  # passes begun in this process
        self._pass: _Pass | None = None
        self._workers: int | None = None  # as a loaded state says; checked against the DataLoader's

    def _loader(self) -> Loader | MixedLoader:
        if self._loader_made is None:
            if self._recipe is not None:
                self._loader_made = self._mixture(self._recipe)
                return self._loader_made
            assert self._lazy is not None
            dataset: Dataset | Subset = self._lazy.dataset
            if self._rows is not None:
                version, rows = self._rows
                if dataset.build_id != version:
                    raise ResumeMismatchError(
                        f"{self._lazy.path} was rebuilt since the subset was made of it: make the subset again"
                    )
                dataset = Subset(dataset, rows)
            self._loader_made = dataset.loader(rank=self.rank, world_size=self.world_size, **self._options)
        return self._loader_made

    def _mixture(self, recipe: dict[str, Any]) -> MixedLoader:
        """The mixture made again here: each source opened (refused if rebuilt since), its subset taken."""
        sources: dict[str, Any] = {}
        for name, (path, storage_options, selected, version) in recipe["sources"].items():
            dataset = Dataset(
                path, storage_options=storage_options, cache_dir=self._cache[0], cache_limit=self._cache[1]
            )
            if dataset.build_id != version:
                raise ResumeMismatchError(f"{path} (source {name!r}) was rebuilt since the mixture was made of it")
            sources[name] = dataset if selected is None else Subset(dataset, selected)
        options = {**recipe["options"], "partitions": self._options["partitions"]}
        return MixedLoader(sources, recipe["weights"], rank=self.rank, world_size=self.world_size, **options)

    def __getstate__(self) -> dict[str, Any]:
        state = {**self.__dict__, "_loader_made": None}
        if not pickled_for_a_child():  # a copy, not a worker being started: its own epoch
            state["_epoch"] = RawValue("q", self.epoch)
            state["_workers_said"] = RawValue("q", self._workers_said.value)
            state["_advanced"], state["_advancing"] = RawArray("q", [-1, -1, -1]), SharedLock()
            state["_ring"] = None  # (its slots are this process's workers'; a copy's batches go the usual way)
        return state

    @property
    def epoch(self) -> int:
        return int(self._epoch.value)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` from its beginning, unless it is the one this stream is in."""
        if epoch != self.epoch:
            self._loader().set_epoch(epoch)  # checks it
            self._epoch.value, self._pass = int(epoch), None

    def __len__(self) -> int:
        """This rank's steps left in the current epoch (all workers together). Partitions not
        given nor loaded are one per rank x DataLoader worker, which the main process learns
        when the workers begin: before, it counts one per rank."""
        if self._partitions is None and self._workers_said.value:
            self._loader().with_partitions(self._workers_said.value)
        current = self._current()
        return len(self._loader().batches(current.start, current.epoch)) - current.yielded  # (all workers together)

    def _current(self) -> _Pass:
        """The pass this process is in or will take up: its own (running, left part way, loaded)
        unless the shared epoch has been set since, else the shared epoch's from the start."""
        epoch = self._epoch_of_this_pass()
        if self._pass is None or self._pass.seen != epoch:
            self._pass = _Pass(epoch, seen=epoch)
        return self._pass

    def _epoch_of_this_pass(self) -> int:
        """The shared epoch, or the one a DataLoader worker of this same pass moved it on from
        (it handed out its share before this worker began: workers start when they are scheduled)."""
        with self._advancing.held():
            if self._pass_key is not None and tuple(self._advanced[:2]) == self._pass_key:
                return int(self._advanced[2])
            return self.epoch

    def _begin_pass(self) -> None:
        """Name this DataLoader pass as all its workers can: by the seed the DataLoader drew for
        it (new for each pass of workers made per pass) and the passes this worker has begun
        (persistent workers keep their seed and begin each pass once)."""
        info = get_worker_info()
        self._passes += 1
        self._pass_key = None if info is None else ((info.seed - info.id) % 2**62, self._passes)

    @staticmethod
    def _worker() -> tuple[int, int]:
        info = get_worker_info()
        return (0, 1) if info is None else (info.id, info.num_workers)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        # the pass is settled here, not when the first batch is asked for: StatefulDataLoader
        # takes a worker's state between the two
        worker, workers = self._worker()
        if self._workers is not None and self._workers != workers:
            raise ResumeMismatchError(
                f"the state was saved with {self._workers} DataLoader workers, this DataLoader has {workers}"
            )
        self._begin_pass()
        if self._partitions is None:  # fixed by the first pass: one share per rank x worker
            self._partitions = self._workers_said.value = self.world_size * workers
        self._loader().with_partitions(self._partitions, workers)
        current = self._current()
        steps = self._loader().batches(current.start, current.epoch, worker, workers)
        return self._run(current, steps[current.yielded :])

    def _run(self, current: _Pass, steps: Sequence[int]) -> Iterator[Any]:
        loader = self._loader()
        ring = self._ring if get_worker_info() is not None else None  # (in the main process: no crossing)
        allocate = ring.allocate if ring is not None else None
        for step, batch in enumerate(loader.read_steps(current.epoch, steps, allocate), 1):
            current.yielded += 1  # counted before the caller has it: a state then saved skips it
            if step == len(steps):
                self._next_epoch(current)
            made = to_torch(batch)
            if self.transform is not None:
                made = self.transform(made)
            yield made if ring is None else SlotBatch(made)
        if not steps:
            self._next_epoch(current)

    def _next_epoch(self, current: _Pass) -> None:
        """This process's share of the epoch is handed out: its state is now the next epoch's start."""
        with self._advancing.held():
            if self.epoch == current.epoch:  # the first of this pass's workers to finish
                self._epoch.value = current.epoch + 1
                if self._pass_key is not None:
                    self._advanced[:] = [*self._pass_key, current.epoch]
        self._pass, self._workers = _Pass(current.epoch + 1, seen=current.epoch + 1), None

    def state_dict(self) -> dict[str, Any]:
        """Where this process's share stands: the loader's state of the pass's start, and the
        steps this DataLoader worker (or the main process) has handed out since, on how many ranks."""
        worker, workers = self._worker()
        current = self._pass if self._pass is not None else self._current()
        loader = self._loader()
        if isinstance(loader, MixedLoader):
            loader.at_epoch(current.epoch)  # its streams' places at that epoch's start
        state = loader.state_dict()
        state.update(epoch=current.epoch, position=current.start, worker=worker, workers=workers)
        state.update(yielded=current.yielded, world_size=self.world_size)
        return state

    def layout_differs(self, loader_state: Mapping[str, Any], saved_workers: int, workers: int) -> bool:
        """A `StatefulDataLoader` state saved with other DataLoader workers or on another world size."""
        worlds = {state.get("world_size", self.world_size) for state in stream_states(loader_state)}
        return saved_workers != workers or worlds != {self.world_size}

    def rank_state(self, loader_state: Mapping[str, Any]) -> dict[str, Any] | None:
        """A `StatefulDataLoader` state's place of this rank as one consumer's state: its
        workers' pass start moved on by the steps the rank has had (they hand them out in turn),
        so that any workers on any world size of the family go on from there; None when the
        state does not say."""
        states, steps = stream_states(loader_state), rank_steps(loader_state)
        if not states or steps is None or not all(isinstance(s.get("epoch"), int) for s in states):
            return None
        if finished(loader_state):  # every worker is at the next epoch's start
            return {**max(states, key=lambda s: int(s["epoch"])), "yielded": 0, "worker": 0, "workers": 1}
        epoch = min(int(s["epoch"]) for s in states)
        current = [s for s in states if s["epoch"] == epoch]  # (the others have handed out their share)
        if len({s.get("position") for s in current}) != 1 or any(s["epoch"] > epoch + 1 for s in states):
            return None
        if sum(int(s.get("yielded", 0)) for s in current) > steps:
            return None
        world = int(current[0].get("world_size", self.world_size))
        return {
            **current[0],
            "position": int(current[0]["position"]) + steps * world,
            "yielded": 0,
            "worker": 0,
            "workers": 1,
        }

    def any_workers(self) -> None:
        """A loaded state of one consumer that any number of DataLoader workers share."""
        self._workers = None

    def dataloader(self, num_workers: int = 0, **options: Any) -> Any:
        """torchdata's `StatefulDataLoader` over this stream (`batch_size=None`: the batches are the
        stream's; `options` are the loader's), whose `load_state_dict` takes a state saved with
        other `num_workers` or on another world size of the family (torchdata's own fails on an
        assertion: its state holds one position per worker, each counting only that worker's steps)."""
        return _stateful_loader_class()(self, batch_size=None, num_workers=num_workers, **options)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`. Saved on another world size, a state of a rank without
        DataLoader workers continues exactly (every rank had taken `yielded` steps of the global
        order: the position is moved past them); one worker's state alone is refused in one line
        (it holds its own count only, not the rank's: `dataloader()` reads the rank's from all)."""
        self._partitions = self._loader().check_state(state)
        self._loader().with_partitions(self._partitions, self._worker()[1])
        if isinstance(loader := self._loader(), MixedLoader):
            loader.load_state_dict(state)  # its streams' places
        # world_size not said: a state of an earlier batchctl, taken as this world size's
        counts = {"workers": 1, "worker": 0, "yielded": 0, "world_size": self.world_size}
        counts = {name: state.get(name, default) for name, default in counts.items()}
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in counts.values()) or not (
            counts["world_size"] >= 1 and 0 <= counts["worker"] < counts["workers"]
        ):
            raise ResumeMismatchError(f"the state's DataLoader workers, steps and world size are not right: {counts}")
        workers, worker, yielded, world = counts.values()
        position = state["position"]
        if world != self.world_size:
            if workers > 1:
                raise ResumeMismatchError(
                    f"the state was saved on {world} ranks with {workers} DataLoader workers each, and resumes only on "
                    f"{world} ranks (this is {self.world_size}) in a plain StatefulDataLoader; "
                    "stream.dataloader(...) resumes it on any number"
                )
            position, yielded = position + yielded * world, 0
        share = len(self._loader().batches(position, state["epoch"], worker, workers))
        if yielded > share:
            raise ResumeMismatchError(
                f"the state's yielded {yielded} is more than the {share} steps this share of the epoch has"
            )
        self._pass = _Pass(state["epoch"], seen=self.epoch, start=position, yielded=yielded)
        self._workers = workers
