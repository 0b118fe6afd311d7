"""Mixtures: several datasets (or subsets) read as one stream of batches, with weights.

Every batch holds a fixed number of rows of each source: the batch size apportioned to the weights
by largest remainders (`counts`), so the proportions are exact in every batch (0.7/0.3 of 64:
45 and 19 rows). Each source is an endless stream of its own rows: its epochs one after another,
each in a fresh order (`read/order.py`, seeded by the mixture's seed and the source's name), so a
source smaller than its share repeats in a new order and a larger one is cut, the next mixture
epoch going on where this one stopped. A mixture epoch is `epoch_size` rows (default: the
largest-weighted source used about once).

Read once, as the loader: each source's epochs are dealt into the mixture's `partitions`, and
mixture batch j takes its rows from partition j % partitions of every source, so consumers that
divide the partitions read disjoint stored batches. The resume state is the position in the
mixture epoch and, per source and partition, how many of its stream's rows came before (an
anchor): a state loaded with other weights continues from the next batch with the new counts,
repeating nothing already given.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from batchctl.errors import ResumeMismatchError, UsageError
from batchctl.read.augment import Decoded, crop_of, image_fields
from batchctl.read.loader import (
    POOL,
    Allocate,
    Batch,
    BatchSource,
    check_ragged_mode,
    default_prefetch,
    is_text,
    object_fields,
    ragged_output,
    read_into,
)
from batchctl.read.order import (
    ORDER_VERSION,
    EpochOrder,
    OrderOptions,
    check_rank,
    consumer_steps,
    earlier_order_problem,
    family_problem,
    share_layout,
)
from batchctl.read.views import FieldsOf, Readable

STATE_FORMAT = "batchctl.mix/1"
DATASET = "dataset"  # the field naming each row's source (its index in the mixture's sources)


def counts(weights: Sequence[float], batch_size: int) -> list[int]:
    """Rows of each source in every batch: `batch_size` apportioned to `weights` by largest remainders."""
    largest = max(weights)  # (scaled first: weights of 1e308 would add up to inf)
    total = float(sum(w / largest for w in weights))
    quotas = [w / largest / total * batch_size for w in weights]
    got = [int(q) for q in quotas]
    by_remainder = sorted(range(len(weights)), key=lambda k: (-(quotas[k] - got[k]), k))
    for k in by_remainder[: batch_size - sum(got)]:
        got[k] += 1
    return got


@dataclass(frozen=True)
class MixOptions:
    batch_size: int
    shuffle: bool
    seed: int
    mix: int
    partitions: int
    epoch_size: int | None  # rows of a mixture epoch; None: the largest-weighted source used once


class _Stream:
    """One source's rows as an endless stream per partition: its epochs (cycles) one after another."""

    def __init__(self, name: str, dataset: BatchSource, options: MixOptions) -> None:
        self.name, self.dataset = name, dataset
        seed = int.from_bytes(hashlib.sha256(f"{options.seed}\0{name}".encode()).digest()[:4], "big")
        self.order_options = OrderOptions(1, options.shuffle, seed, options.mix, False, options.partitions)
        self._orders: OrderedDict[int, EpochOrder] = OrderedDict()  # a few recent cycles, shared by the partitions
        self._shares: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        # each partition's rows of a cycle: the same in every cycle (not an order's, which a cycle
        # cache could have let go: pieces() asks for every batch)
        self.share_rows = share_layout(dataset.num_samples, 1, options.partitions)[1]

    def order(self, cycle: int) -> EpochOrder:
        order = self._orders.get(cycle)
        if order is None:
            ds = self.dataset
            order = EpochOrder(ds.num_samples, ds.batch_size, self.order_options, cycle, ds.selected, ds.stored_rows)
            self._orders[cycle] = order
            if len(self._orders) > 4:
                self._orders.popitem(last=False)
        return order

    def share(self, cycle: int, partition: int) -> np.ndarray:
        """Partition `partition`'s rows of cycle `cycle`, in order (global row indices)."""
        key = (cycle, partition)
        rows = self._shares.get(key)
        if rows is None:
            order = self.order(cycle)
            groups = range(int(order.first_group[partition]), int(order.first_group[partition + 1]))
            rows = np.concatenate([order.group_rows(g) for g in groups] or [np.zeros(0, np.int64)])
            self._shares[key] = rows
            if len(self._shares) > 16:
                self._shares.popitem(last=False)
        return rows

    def pieces(self, partition: int, start: int, stop: int) -> list[tuple[int, np.ndarray]]:
        """The rows at stream offsets [start, stop) of a partition, as (cycle, rows) pieces (a
        partition's share of a cycle has as many rows in every cycle)."""
        length = int(self.share_rows[partition])
        if not length:
            raise UsageError(f"source {self.name!r} has no rows for partition {partition}: use fewer partitions")
        out = []
        while start < stop:
            cycle, at = divmod(start, length)
            end = min(stop, (cycle + 1) * length)
            out.append((cycle, self.share(cycle, partition)[at : at + end - start]))
            start = end
        return out


_WINDOW = 4096  # batches planned at once


class MixedLoader:
    """A loader over several datasets (opened ones, subsets, or paths/URLs) at `weights`, for one
    rank, epoch after epoch, with a resume state (`batchctl.mix`): every batch holds `batch_size`
    apportioned to the weights (exact in every batch), a `dataset` field saying each row's source
    (its index in `sources`), and the fields the sources share (or `fields`); ragged fields and
    encoded images as `Dataset.loader` gives them (`ragged`, `random_resized_crop`, `center_crop`,
    `flip`, `scale`, `ratio`). See the module's docstring for epochs, repeats and resume."""

    def __init__(
        self,
        sources: Mapping[str, Readable | str | os.PathLike[str]],
        weights: Mapping[str, float],
        batch_size: int,
        epoch_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        mix: int = 16,
        rank: int = 0,
        world_size: int = 1,
        prefetch: int | None = None,
        fields: Sequence[str] | None = None,
        partitions: int | None = None,
        ragged: str = "list",
        random_resized_crop: int | None = None,
        center_crop: int | None = None,
        flip: bool = False,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
    ) -> None:
        self.names = list(sources)
        self.ragged = check_ragged_mode(ragged)
        self.crop = crop_of(random_resized_crop, center_crop, flip, scale, ratio)
        if not self.names or set(weights) != set(self.names):
            raise UsageError(f"Expected a weight for each of {self.names}, got {dict(weights)!r} instead.")
        numbers = all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights.values())
        if not numbers or not all(0 < w < math.inf for w in weights.values()):
            raise UsageError(f"Expected finite weights > 0, got {dict(weights)!r} instead.")
        checked = OrderOptions(
            batch_size, bool(shuffle), seed, mix, True, world_size if partitions is None else partitions
        )
        checked = checked.checked()
        check_rank(rank, world_size)
        if problem := family_problem(checked.partitions, world_size):
            raise UsageError(problem[0].upper() + problem[1:])
        if epoch_size is not None and (
            isinstance(epoch_size, bool) or not isinstance(epoch_size, int) or not 1 <= epoch_size < 2**62
        ):
            raise UsageError(f"Expected epoch_size to be a number of rows from 1 to 2**62, got {epoch_size!r} instead.")
        self.rank, self.world_size, self.partitions_given = rank, world_size, partitions is not None
        self.options = MixOptions(
            checked.batch_size, checked.shuffle, checked.seed, checked.mix, checked.partitions, epoch_size
        )
        self.opened = {name: _opened(ds) for name, ds in sources.items()}  # as given (paths opened)
        self.fields_asked = None if fields is None else list(fields)
        self.sources: dict[str, BatchSource] = {
            name: ds if fields is None else FieldsOf(ds, fields) for name, ds in self.opened.items()
        }
        self.fields = _shared_fields(self.sources)
        # encoded images every source holds, decoded and cropped as they are read (`augment.Decoded`)
        every = [set(image_fields(source.encodings)) for source in self.sources.values()]
        self.images = sorted(set.intersection(*every)) if self.crop is not None else []
        if self.crop is not None and not self.images:
            raise UsageError("the sources share no encoded image field to crop (build them with --store jpeg or png)")
        first = next(iter(self.sources.values())).fields
        self.ragged_names = [
            n for n in object_fields(first) if n in self.fields and not is_text(first[n][1]) and n not in self.images
        ]
        # one group of each source ahead: the reads of every source share the window (`_MixReads`)
        self.prefetch = default_prefetch(checked.mix, checked.shuffle, remote=True) if prefetch is None else prefetch
        self.weights = {name: float(weights[name]) for name in self.names}
        self.counts = counts([self.weights[n] for n in self.names], self.batch_size)
        if 0 in self.counts:
            none = self.names[self.counts.index(0)]
            raise UsageError(
                f"source {none!r} gets no row of a batch of {self.batch_size} at weight {self.weights[none]}: "
                "raise its weight or batch_size"
            )
        self._streams = self._make_streams()
        self.steps = self._steps()
        self.epoch, self.position = 0, 0
        self._place_streams()

    @property
    def batch_size(self) -> int:
        return self.options.batch_size

    @property
    def shuffle(self) -> bool:
        return self.options.shuffle

    @property
    def seed(self) -> int:
        return self.options.seed

    @property
    def mix(self) -> int:
        return self.options.mix

    def _make_streams(self) -> list[_Stream]:
        """Each source's stream; one with fewer rows than partitions is refused (each partition
        reads rows of its own)."""
        streams = [_Stream(name, self.sources[name], self.options) for name in self.names]
        for stream in streams:
            if stream.dataset.num_samples < self.options.partitions:
                raise UsageError(
                    f"source {stream.name!r} has {stream.dataset.num_samples} rows, fewer than the "
                    f"{self.options.partitions} partitions (one per rank unless partitions= says), each reading rows "
                    "of its own: use fewer ranks or partitions"
                )
        return streams

    # --- the order --------------------------------------------------------------------------

    def _place_streams(self) -> None:
        """Each source's stream offset per partition at the current epoch's start (as if the
        current weights had held since the first epoch), anchored at its step 0."""
        self.anchor_steps = [0] * self.options.partitions
        self.offsets = {
            name: [self.epoch * self.steps * count] * self.options.partitions
            for name, count in zip(self.names, self.counts, strict=True)
        }

    def _steps(self) -> int:
        """Batches of each partition a mixture epoch has."""
        partitions, size = self.options.partitions, self.batch_size
        if self.options.epoch_size is not None:
            steps = self.options.epoch_size // size // partitions
        else:
            k = max(range(len(self.names)), key=lambda i: (self.weights[self.names[i]], -i))
            steps = self.sources[self.names[k]].num_samples // partitions // self.counts[k]
        if steps < 1:
            raise UsageError(
                f"an epoch of {self.options.epoch_size or 'one pass of the largest-weighted source'} rows makes no "
                f"batch of {size} for each of {partitions} partitions: raise epoch_size or lower batch_size"
            )
        return steps

    @property
    def total(self) -> int:
        """Batches of a mixture epoch, all ranks together."""
        return self.steps * self.options.partitions

    def _spans(self, batch: int) -> list[tuple[int, int, int]]:
        """Global batch `batch` of the current epoch as (partition, start, stop) stream offsets per source."""
        partitions = self.options.partitions
        p, t = batch % partitions, batch // partitions
        spans = []
        for name, count in zip(self.names, self.counts, strict=True):
            start = self.offsets[name][p] + (t - self.anchor_steps[p]) * count
            spans.append((p, start, start + count))
        return spans

    def batches(
        self, position: int | None = None, epoch: int | None = None, worker: int = 0, workers: int = 1
    ) -> Sequence[int]:
        """This rank's batches of an epoch from `position` (every mixture epoch has as many), or
        DataLoader worker `worker` of `workers`'s share of them."""
        position = self.position if position is None else position
        return consumer_steps(self.total, position, self.rank, self.world_size, True, worker, workers)

    def __len__(self) -> int:
        return len(self.batches())

    def set_epoch(self, epoch: int) -> None:
        """Start mixture epoch `epoch` from its beginning (the streams' places follow from the
        epochs before it at the current weights), unless it is the one this loader is in."""
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise UsageError(f"Expected epoch to be an int >= 0, got {epoch!r} instead.")
        if epoch != self.epoch:
            self.epoch, self.position = int(epoch), 0
            self._place_streams()

    def _next_epoch(self) -> None:
        for name, count in zip(self.names, self.counts, strict=True):
            self.offsets[name] = [
                offset + (self.steps - anchor) * count
                for offset, anchor in zip(self.offsets[name], self.anchor_steps, strict=True)
            ]
        self.anchor_steps = [0] * self.options.partitions
        self.epoch, self.position = self.epoch + 1, 0

    # --- reading ----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        steps = self.batches()
        for step, batch in enumerate(self._read(steps), 1):
            self.position += self.world_size  # counted before the caller has it
            if step == len(steps):
                self._next_epoch()
            yield batch
        if not steps:
            self._next_epoch()

    def _read(self, wanted: Sequence[int], allocate: Allocate | None = None) -> Iterator[Batch]:
        """Batches `wanted`, planned and read a window at a time (an epoch may be longer than
        its plans would fit in memory); a stored batch a window's end cuts is read by both."""
        for first in range(0, len(wanted), _WINDOW):
            window = wanted[first : first + _WINDOW]
            plans = [[self._streams[k].pieces(*span) for k, span in enumerate(self._spans(j))] for j in window]
            reads = _MixReads(
                [s.dataset for s in self._streams], self.fields, self.counts, plans, self.prefetch, self._view, allocate
            )
            try:
                for i in range(len(plans)):
                    yield ragged_output(reads.cut(i), self.ragged_names, self.ragged)
            finally:
                reads.close()

    # --- resume -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "sources": {name: _version(self.sources[name]) for name in self.names},
            "options": dataclasses.asdict(self.options),
            "counts": dict(zip(self.names, self.counts, strict=True)),
            "epoch": self.epoch,
            "position": self.position,
            "anchor_steps": list(self.anchor_steps),
            "offsets": {name: list(values) for name, values in self.offsets.items()},
            "order": ORDER_VERSION,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` (saved on any world size dividing its partitions, which this loader
        takes unless given others); saved with other weights, the epoch goes on with this loader's
        counts from the next batch."""
        self.with_partitions(self.check_state(state))
        epoch, position = int(state["epoch"]), int(state["position"])
        anchors = [int(a) for a in state["anchor_steps"]]
        offsets = {name: [int(v) for v in state["offsets"][name]] for name in self.names}
        old = [int(state["counts"][name]) for name in self.names]
        partitions = self.options.partitions
        if not 0 <= position < self.total or len(anchors) != partitions:
            raise ResumeMismatchError(f"the state's position {position} is not of this mixture ({self.total} batches)")
        if any(len(v) != partitions for v in offsets.values()):
            raise ResumeMismatchError("the state's stream offsets are not of this mixture")
        if old != self.counts:  # new weights: each partition's anchor moves to the batches already taken
            done = [len(range(p, position, partitions)) for p in range(partitions)]
            for name, count in zip(self.names, old, strict=True):
                offsets[name] = [o + (d - a) * count for o, d, a in zip(offsets[name], done, anchors, strict=True)]
            anchors = done
        self.epoch, self.position, self.anchor_steps, self.offsets = epoch, position, anchors, offsets

    def check_state(self, state: Any) -> int:
        """Refuse, in one line naming the difference, a state this mixture cannot continue; return its partitions."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ResumeMismatchError(f"not a batchctl mixture state (expected format {STATE_FORMAT!r})")
        saved = state.get("sources")
        if not isinstance(saved, dict) or list(saved) != self.names:
            raise ResumeMismatchError(f"the state is of a mixture of {list(saved or {})}, this one of {self.names}")
        for name in self.names:
            if saved[name] != _version(self.sources[name]):
                raise ResumeMismatchError(
                    f"source {name!r} is another version than the state's ({self.sources[name].path} was rebuilt, or "
                    "another subset): start the mixture over"
                )
        options = dict(state.get("options") or {})
        partitions = options.get("partitions")
        if isinstance(partitions, bool) or not isinstance(partitions, int) or not 1 <= partitions < 2**31:
            raise ResumeMismatchError(f"the state's partitions are not an int >= 1: {partitions!r}")
        for name, value in dataclasses.asdict(self.options).items():
            if options.get(name) != value and (name != "partitions" or self.partitions_given):
                raise ResumeMismatchError(f"the state was saved with {name}={options.get(name)!r}, this has {value!r}")
        if problem := earlier_order_problem(state, partitions):  # (its streams' offsets too)
            raise ResumeMismatchError(problem)
        try:
            numbers = [state["epoch"], state["position"], *state["anchor_steps"], *state["counts"].values()]
            numbers += [v for name in self.names for v in state["offsets"][name]]
        except (KeyError, TypeError, AttributeError):
            raise ResumeMismatchError("the mixture state is incomplete or damaged") from None
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63 for v in numbers):
            raise ResumeMismatchError("the mixture state's epoch, position and offsets are not ints >= 0")
        return partitions

    def with_partitions(self, partitions: int, workers: int = 1) -> None:
        """Deal the sources into `partitions` (a state's, or one per rank x DataLoader worker);
        refused in one line when the consumers do not divide them."""
        if problem := family_problem(partitions, self.world_size, workers):
            raise ResumeMismatchError(problem)
        if partitions != self.options.partitions:
            self.options = dataclasses.replace(self.options, partitions=partitions)
            self._streams = self._make_streams()
            self.steps = self._steps()
            self._place_streams()  # per partition now

    def at_epoch(self, epoch: int) -> None:
        """Move the streams to mixture epoch `epoch`'s start, unless this loader is in it."""
        if epoch == self.epoch + 1:
            self._next_epoch()  # the streams go on from where this epoch leaves them
        elif epoch != self.epoch:
            self.set_epoch(epoch)

    def read_steps(self, epoch: int, steps: Sequence[int], allocate: Allocate | None = None) -> Iterator[Batch]:
        """Batches `steps` of mixture epoch `epoch` (moving this loader's streams there first),
        made by `allocate` where given."""
        self.at_epoch(epoch)
        return self._read(steps, allocate)

    def output_fields(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        """The numeric fields of the batches handed out, read ones (decoded images' shapes where
        it crops) then `dataset`."""
        fields = self._view(next(iter(self.sources.values())), 0).fields
        numeric = {name: fields[name] for name in self.fields if name not in object_fields(fields)}
        return {**numeric, DATASET: ((), np.dtype(np.int16))}

    def _view(self, source: BatchSource, cycle: int) -> BatchSource:
        """A source as one pass of its stream (`cycle`) reads it: its images decoded and cropped
        with that pass's draws (a row repeated in a later pass gets a crop of its own)."""
        if self.crop is None:
            return source
        return Decoded(source, self.crop, self.images, self.options.seed, cycle)

    def recipe(self) -> dict[str, Any]:
        """What makes this mixture again in another process (`batchctl.torch.IterableBatches`)."""
        return {
            "sources": {
                name: (ds.path, dict(ds.storage_options), ds.selected, ds.build_id) for name, ds in self.opened.items()
            },
            "weights": dict(self.weights),
            "options": {
                "batch_size": self.batch_size,
                "epoch_size": self.options.epoch_size,
                "shuffle": self.shuffle,
                "seed": self.seed,
                "mix": self.mix,
                "prefetch": self.prefetch,
                "fields": self.fields_asked,
                "partitions": self.options.partitions if self.partitions_given else None,
                "ragged": self.ragged,
                **self._crop_options(),
            },
        }

    def _crop_options(self) -> dict[str, Any]:
        crop = self.crop
        if crop is None:
            return {}
        size = {"random_resized_crop" if crop.random else "center_crop": crop.size}
        return {**size, "flip": crop.flip, "scale": crop.scale, "ratio": crop.ratio} if crop.random else size


class _MixReads:
    """The stored batches a pass's batches take rows from, read in threads in the order they are
    first needed (`prefetch` per source ahead), each straight into the places its rows go in
    every batch of the pass that takes them (`loader.read_into`: no gather copy). A stored batch
    is read once per pass of its source's stream (a cycle): the key is (source, cycle, stored)."""

    def __init__(
        self,
        sources: list[BatchSource],
        fields: list[str],
        counts: list[int],
        plans: list[list[list[tuple[int, np.ndarray]]]],
        prefetch: int,
        view: Callable[[BatchSource, int], BatchSource],
        allocate: Allocate | None = None,
    ) -> None:
        self.sources, self.fields, self.counts, self.view = sources, fields, counts, view
        self.allocate = allocate
        first = view(sources[0], 0).fields  # (decoded images' shapes where the mixture decodes)
        self.objects = [name for name in object_fields(first) if name in fields]  # `source`, text, ragged fields
        self.texts = [name for name in self.objects if is_text(first[name][1])]
        self.numeric = {name: first[name] for name in fields if name not in self.objects}
        self.targets: dict[tuple[int, int, int], list[tuple[int, np.ndarray, np.ndarray]]] = {}
        for i, plan in enumerate(plans):
            at = 0
            for k, pieces in enumerate(plan):
                for cycle, rows in pieces:
                    stored, local = np.divmod(rows, sources[k].batch_size)
                    places = at + np.arange(len(rows))
                    for s in np.unique(stored).tolist():
                        mask = stored == s
                        key = (k, cycle, s)
                        self.targets.setdefault(key, []).append((i, places[mask], local[mask]))
                    at += len(rows)
        self.order = list(self.targets)  # in the order first needed
        self.first_need = {key: self.targets[key][0][0] for key in self.order}
        self.need_at = [self.first_need[key] for key in self.order]  # non-decreasing
        self.started = 0
        self.limit = max(prefetch, 1) * len(sources)
        self.outputs: dict[int, Batch] = {}
        self.reads: dict[int, list[Future[None]]] = {}
        self.local = threading.local()
        threads = max(1, min(self.limit, len(os.sched_getaffinity(0))))
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="batchctl-mix")

    def _output(self, i: int) -> Batch:
        if i not in self.outputs:
            size = sum(self.counts)
            made = self.allocate(size, self.numeric) if self.allocate is not None else None
            out = made if made is not None else POOL.allocate(size, self.numeric)
            for name in self.objects:
                out[name] = np.empty(size, dtype=object)
            self.outputs[i] = out
        return self.outputs[i]

    def _start(self, key: tuple[int, int, int]) -> None:
        """Read stored batch `key` once, into every batch of the pass taking rows of it."""
        k, cycle, stored = key
        size = self.sources[k].batch_size
        targets: list[Batch | None] = [None] * size
        place = [0] * size
        fed = []
        for i, places, local in self.targets.pop(key):
            out = self._output(i)
            for p, r in zip(places.tolist(), local.tolist(), strict=True):
                targets[r], place[r] = out, p
            fed.append(i)
        read = self.pool.submit(self._read, self.view(self.sources[k], cycle), stored, targets, place)
        for i in fed:
            self.reads.setdefault(i, []).append(read)

    def _read(self, source: BatchSource, stored: int, targets: list[Batch | None], place: list[int]) -> None:
        got = read_into(source, self.numeric, stored, targets, place, self._scratch)
        for name, rows in got.items():
            for r, (out, p) in enumerate(zip(targets, place, strict=True)):
                if out is not None:
                    out[name][p] = rows[r]

    def _scratch(self, name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        scratch: dict[tuple[str, tuple[int, ...]], np.ndarray] = self.local.__dict__.setdefault("scratch", {})
        if (name, shape) not in scratch:
            scratch[(name, shape)] = np.empty(shape, dtype)
        return scratch[(name, shape)]

    def cut(self, i: int) -> Batch:
        while self.started < len(self.order) and (
            self.need_at[self.started] <= i or self.started - bisect.bisect_right(self.need_at, i) < self.limit
        ):  # every read batch i needs, and up to `limit` more ahead
            self._start(self.order[self.started])
            self.started += 1
        for read in self.reads.pop(i, []):
            read.result()
        out = self.outputs.pop(i)
        for name in self.texts:
            out[name] = np.array(out[name].tolist())
        out[DATASET] = np.repeat(np.arange(len(self.sources), dtype=np.int16), self.counts)
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _opened(dataset: Readable | str | os.PathLike[str]) -> Readable:
    if isinstance(dataset, (str, os.PathLike)):
        from batchctl.read.reader import open as open_dataset

        return open_dataset(dataset)
    return dataset


def _shared_fields(sources: Mapping[str, BatchSource]) -> list[str]:
    """The fields every source has, each the same row shape and kind; any other is refused in one line."""
    first_name, first = next(iter(sources.items()))
    names = list(first.fields)
    for name, source in sources.items():
        if DATASET in source.fields:
            raise UsageError(f"source {name!r} has a field {DATASET!r}, which a mixture adds: pick fields= without it")
        if set(source.fields) != set(names):
            odd = sorted(set(source.fields) ^ set(names))
            raise UsageError(
                f"sources {first_name!r} and {name!r} do not have the same fields ({', '.join(odd)}): pick fields= "
                "they share"
            )
        for field in names:
            (shape, dtype), (theirs, their_dtype) = first.fields[field], source.fields[field]
            strings = dtype.kind in "TUO" and their_dtype.kind in "TUO"
            if shape != theirs or (dtype != their_dtype and not strings):
                raise UsageError(
                    f"field {field!r} is {shape} {dtype} in {first_name!r} but {theirs} {their_dtype} in {name!r}: "
                    "pick fields= without it, or build them alike"
                )
    return names


def _version(dataset: BatchSource) -> dict[str, Any]:
    version: dict[str, Any] = {"build_id": dataset.build_id, "num_samples": dataset.num_samples}
    if dataset.selected is not None:
        version["subset"] = hashlib.sha256(dataset.selected.astype("<i8").tobytes()).hexdigest()[:16]
    return version


mix = MixedLoader  # `batchctl.mix(...)`: the public name


__all__ = ["DATASET", "MixedLoader", "counts", "mix"]
