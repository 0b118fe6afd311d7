"""Training reads: one row order per epoch, cut into batches of any size and shared by ranks.

The order is a pure function of (seed, epoch, the dataset, batch_size, mix, drop_last), computed
the same way by every rank, every world size and every DataLoader worker. So a position in it
(how many output batches all ranks together have taken) is a complete, tiny resume state that
means the same rows on any number of ranks: exact and elastic resume are the same operation.

How an epoch is ordered (`EpochOrder`): with `shuffle`, the stored batches are visited in an
order seeded by (seed, epoch), `mix` at a time, each group drawn across the whole dataset
(`_visit_order`); the rows of each group are permuted together (seeded by seed, epoch and the
group), the groups' rows follow one another, and that row sequence is cut into output batches of
`batch_size`. `mix=1` keeps each stored batch's rows in stored order
(the batch-level shuffle: no gather, the fastest). Without `shuffle`, rows come in stored order.
Output batch j of the epoch goes to rank j % world_size, so ranks take disjoint, equally long
shares: `drop_last` leaves out the short last batch and the batches that cannot be shared evenly;
without it the last round is filled from the epoch's first batches (as torch's DistributedSampler
pads), so every rank still takes as many steps.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Protocol, cast

import numpy as np

from batchctl.errors import ResumeMismatchError, UsageError, warn
from batchctl.store.metadata import SOURCE

STATE_FORMAT = "batchctl.loader/1"

Batch = dict[str, np.ndarray]


class BatchSource(Protocol):
    """What a loader reads: `batchctl.Dataset` (reader.py imports this module, not the reverse)."""

    path: str
    build_id: str
    batch_size: int
    num_samples: int  # the rows read: all of the dataset's, or a subset's
    remote: bool  # on an object store: reads wait on the network, not on a core

    @property
    def selected(self) -> np.ndarray | None: ...  # a subset's rows (sorted global indices), or None: all

    stored_rows: int  # the dataset's rows, however many are read

    @property
    def fields(self) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]: ...

    def __getitem__(self, index: int) -> Batch: ...

    def read_batch(
        self, index: int, into: Mapping[str, list[np.ndarray]] | None = None, fields: list[str] | None = None
    ) -> Batch: ...


@dataclass(frozen=True)
class OrderOptions:
    """What an epoch's order depends on besides the dataset and the epoch (a resume state must match)."""

    batch_size: int
    shuffle: bool
    seed: int
    mix: int
    drop_last: bool

    def checked(self) -> OrderOptions:
        """These options with plain ints (a NumPy int would not go into a JSON state), or a UsageError."""
        for name, least in (("batch_size", 1), ("mix", 1), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
                raise UsageError(f"Expected {name} to be an int >= {least}, got {value!r} instead.")
        return OrderOptions(
            int(self.batch_size), bool(self.shuffle), int(self.seed), int(self.mix), bool(self.drop_last)
        )


class EpochOrder:
    """One epoch's rows, as a sequence of output batches of global row indices.

    Nothing of size num_samples is built: the visit order of stored batches is one index per
    stored batch, and a group's row permutation is made when a batch of that group is asked for.
    """

    def __init__(
        self,
        num_samples: int,
        stored_batch: int,
        options: OrderOptions,
        epoch: int,
        selected: np.ndarray | None = None,
        stored_rows: int | None = None,
    ) -> None:
        """`selected`: a subset's rows (sorted global indices) of a dataset of `stored_rows` rows;
        only the stored batches holding them are visited, and only they are ordered."""
        self.num_samples, self.stored_batch, self.options = num_samples, stored_batch, options
        self.selected = selected
        rng = np.random.default_rng([options.seed, epoch])
        self.visit: np.ndarray  # the stored batches read, in visit order, `group` at a time
        if selected is None:
            stored, short = divmod(num_samples, stored_batch)
            self.visit, self.group = (
                _visit_order(stored, options.mix, rng) if options.shuffle else (np.arange(stored), 1)
            )
            # a short last stored batch is visited last: the others' rows then line up with output
            # batches of the stored size (at mix=1, the stored batches themselves), and it ends its group
            if short:
                self.visit = np.append(self.visit, stored)
                stored += 1
            lengths = np.full(stored, stored_batch, dtype=np.int64)
            if stored:
                lengths[-1] = num_samples - (stored - 1) * stored_batch
        else:
            stored = -(-(num_samples if stored_rows is None else stored_rows) // stored_batch)
            lengths = np.bincount(selected // stored_batch, minlength=stored).astype(np.int64)
            present = np.flatnonzero(lengths)  # only the stored batches holding its rows are read
            found, self.group = (
                _visit_order(len(present), options.mix, rng) if options.shuffle else (np.arange(len(present)), 1)
            )
            self.visit = present[found]
        self.permute = options.shuffle and options.mix > 1
        self.epoch = epoch
        self.slot = np.zeros(stored, dtype=np.int64)  # each visited stored batch's place in its group
        self.slot[self.visit] = np.arange(len(self.visit)) % self.group
        visited = lengths[self.visit]
        groups = math.ceil(len(self.visit) / self.group)
        sizes = np.add.reduceat(visited, np.arange(groups) * self.group) if groups else np.zeros(0, np.int64)
        self.group_start = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.batches = epoch_batches(num_samples, options)
        self._rows: OrderedDict[int, np.ndarray] = OrderedDict()

    def stored_of_group(self, group: int) -> np.ndarray:
        return self.visit[group * self.group : (group + 1) * self.group]

    def group_rows(self, group: int) -> np.ndarray:
        """The group's global row indices in epoch order (a few recent groups are kept)."""
        rows = self._rows.get(group)
        if rows is None:
            size, selected = self.stored_batch, self.selected
            if selected is None:
                ranges = [
                    np.arange(s * size, min((s + 1) * size, self.num_samples)) for s in self.stored_of_group(group)
                ]
            else:
                bounds = [np.searchsorted(selected, [s * size, (s + 1) * size]) for s in self.stored_of_group(group)]
                ranges = [selected[lo:hi] for lo, hi in bounds]
            rows = np.concatenate(ranges)
            if self.permute:
                rows = np.random.default_rng([self.options.seed, self.epoch, 1, group]).permutation(rows)
            self._rows[group] = rows
            if len(self._rows) > 4:
                self._rows.popitem(last=False)
        return rows

    def groups_of(self, batch: int) -> range:
        """The groups output batch `batch` takes rows from, in epoch order."""
        start, stop = self._span(batch)
        first = int(np.searchsorted(self.group_start, start, side="right")) - 1
        last = int(np.searchsorted(self.group_start, stop - 1, side="right")) - 1
        return range(first, last + 1)

    def parts(self, batch: int) -> list[tuple[int, np.ndarray]]:
        """Output batch `batch` as (group, its global row indices) for each group it takes rows from."""
        start, stop = self._span(batch)
        parts = []
        for group in self.groups_of(batch):
            base = int(self.group_start[group])
            parts.append((group, self.group_rows(group)[max(start - base, 0) : stop - base]))
        return parts

    def rows(self, batch: int) -> np.ndarray:
        """Global row indices of output batch `batch`, in order."""
        parts = [rows for _, rows in self.parts(batch)]
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def in_group(self, rows: np.ndarray) -> np.ndarray:
        """Where global rows lie in their group's rows laid end to end in visit order."""
        stored, row = np.divmod(rows, self.stored_batch)
        return self.slot[stored] * self.stored_batch + row

    def _span(self, batch: int) -> tuple[int, int]:
        if not 0 <= batch < self.batches:
            raise IndexError(f"output batch {batch} out of range: the epoch has {self.batches}")
        start = batch * self.options.batch_size
        return start, min(start + self.options.batch_size, self.num_samples)


def epoch_batches(num_samples: int, options: OrderOptions) -> int:
    """The output batches of an epoch (all ranks together)."""
    batch = options.batch_size
    return num_samples // batch if options.drop_last else math.ceil(num_samples / batch)


def _visit_order(stored: int, mix: int, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """The order stored batches are visited in, `mix` at a time (a group per `mix` of them).

    A group takes one stored batch from each of `mix` bands of consecutive stored batches, each
    band's chosen at random, and the full groups come in random order (a short one last). So a
    group spans the whole dataset: in a build whose rows are sorted by class, each group holds
    every class in proportion, where `mix` batches drawn at random would miss some (16 of 128
    sorted batches of 10 classes: 8.8 classes per output batch where a global permutation gives
    10). On rows in no particular order it is as random as a plain permutation."""
    if mix == 1:
        return rng.permutation(stored), 1
    bands = [rng.permutation(band) for band in np.array_split(np.arange(stored), mix)]
    full = stored // mix  # groups with one batch from every band; the first stored % mix bands have one more
    groups = np.array([band[:full] for band in bands], dtype=np.int64).T.reshape(full, mix)
    partial = np.array([band[full] for band in bands if len(band) > full], dtype=np.int64)
    return np.concatenate([groups[rng.permutation(full)].reshape(-1), partial]), mix


def rank_batches(total: int, position: int, rank: int, world_size: int, drop_last: bool) -> range | list[int]:
    """The output batches rank `rank` takes from `position` on (a position counts the batches all
    ranks together have taken: it is the same number on every rank)."""
    left = max(total - position, 0)
    if drop_last:
        return range(position + rank, position + (left // world_size) * world_size, world_size)
    steps = math.ceil(left / world_size)
    return [(position + t * world_size + rank) % total for t in range(steps)] if total else []


def gather(batches: dict[int, Batch], rows: np.ndarray, stored_batch: int) -> Batch:
    """Output rows `rows` (global indices) from the stored batches that hold them.

    A few runs of consecutive rows (no shuffle, or mix=1) are slices: one run is a view of its
    stored batch, no copy; rows in any other order are gathered."""
    owner, local = np.divmod(rows, stored_batch)
    cuts = np.flatnonzero((np.diff(rows) != 1) | (np.diff(owner) != 0)) + 1
    if len(cuts) < 8:
        bounds = zip(np.concatenate([[0], cuts]).tolist(), np.concatenate([cuts, [len(rows)]]).tolist(), strict=True)
        pieces = [(int(owner[lo]), int(local[lo]), int(local[lo]) + hi - lo) for lo, hi in bounds]
        if len(pieces) == 1:
            b, lo, hi = pieces[0]
            return {name: column[lo:hi] for name, column in batches[b].items()}
        names = batches[pieces[0][0]].keys()
        return {name: np.concatenate([batches[b][name][lo:hi] for b, lo, hi in pieces]) for name in names}
    sources = [(int(b), np.flatnonzero(owner == b)) for b in np.unique(owner)]
    first = batches[sources[0][0]]
    out: Batch = {}
    for name, column in first.items():
        dtype = np.result_type(*(batches[b][name].dtype for b, _ in sources))
        result = np.empty((len(rows), *column.shape[1:]), dtype=dtype)
        for b, where in sources:
            result[where] = batches[b][name][local[where]]
        out[name] = result
    return out


class Loader:
    """Batches for one rank, epoch after epoch, with a resume state.

    Iterating runs the current epoch from the current position; handing out the epoch's last
    batch moves on to the next epoch (so `for batch in loader` twice gives two epochs, and a state
    saved then starts the next one), and a pass left part way continues where it stopped.
    `set_epoch(e)` starts epoch e from its beginning unless e is the epoch the loader is in (so
    `load_state_dict` then `set_epoch` of the saved epoch still resumes).
    """

    def __init__(
        self,
        dataset: BatchSource,
        batch_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        mix: int = 16,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = True,
        prefetch: int | None = None,
    ) -> None:
        self.dataset = dataset
        size = dataset.batch_size if batch_size is None else batch_size
        self.options = OrderOptions(size, bool(shuffle), seed, mix, bool(drop_last)).checked()
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise UsageError(f"Expected world_size to be a positive int, got {world_size!r} instead.")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise UsageError(f"Expected 0 <= rank < world_size, got rank {rank!r}, world_size {world_size} instead.")
        self.rank, self.world_size = rank, world_size
        total = epoch_batches(dataset.num_samples, self.options)
        if self.options.drop_last and total < world_size:  # some rank would get nothing, silently
            raise UsageError(
                f"{dataset.num_samples} samples make {total} batches of {self.options.batch_size} an epoch, fewer than "
                f"the {world_size} ranks: lower batch_size or world_size, or pass drop_last=False (the last "
                "round is then filled from the epoch's first batches)"
            )
        # one group read ahead by default (at least 2 batches), so the next group is read while this one is cut
        self.prefetch = max(self.options.mix if self.options.shuffle else 1, 2) if prefetch is None else prefetch
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise UsageError(f"Expected prefetch to be an int >= 0, got {prefetch!r} instead.")
        self.epoch, self.position = 0, 0
        self._order: EpochOrder | None = None
        self._loaded: tuple[int, int] | None = None  # a state just loaded, until the loader is read

    def order(self, epoch: int | None = None) -> EpochOrder:
        """The order of `epoch` (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        if self._order is None or self._order.epoch != epoch:
            dataset = self.dataset
            self._order = EpochOrder(
                dataset.num_samples, dataset.batch_size, self.options, epoch, dataset.selected, dataset.stored_rows
            )
        return self._order

    def set_epoch(self, epoch: int) -> None:
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) or epoch < 0:
            raise UsageError(f"Expected epoch to be an int >= 0, got {epoch!r} instead.")
        if epoch != self.epoch:
            if self._loaded is not None and self._loaded[1]:  # a newcomer's start_epoch = 0 after a resume
                warn(
                    f"set_epoch({epoch}) discards the state just loaded (epoch {self._loaded[0]}, position "
                    f"{self._loaded[1]}): start from loader.epoch after load_state_dict to resume it"
                )
            self.epoch, self.position = int(epoch), 0
        self._loaded = None

    def batches(self, position: int | None = None, epoch: int | None = None) -> Sequence[int]:
        """This rank's output batches of `epoch` from `position` (default: the current ones)."""
        position = self.position if position is None else position
        total = self.order(epoch).batches
        return rank_batches(total, position, self.rank, self.world_size, self.options.drop_last)

    def __len__(self) -> int:
        """This rank's steps left in the current epoch (all of them before a pass begins)."""
        return len(self.batches())

    def __iter__(self) -> Iterator[Batch]:
        self._loaded = None
        order, steps = self.order(), self.batches()
        for step, batch in enumerate(self.read(order, steps), 1):
            # counted before the caller has the batch, so a state saved then skips it; after the
            # epoch's last one, a saved state is the next epoch's start
            self.position += self.world_size
            if step == len(steps):
                self.epoch, self.position = self.epoch + 1, 0
            yield batch
        if not steps:  # nothing was left of this epoch
            self.epoch, self.position = self.epoch + 1, 0

    def read(self, order: EpochOrder, batches: Iterable[int]) -> Iterator[Batch]:
        """Output batches `batches` of `order`, in that order, reading stored batches ahead in threads."""
        return _read(self.dataset, order, batches, self.prefetch)

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands, as plain JSON-able data: the same on every rank."""
        return {
            "format": STATE_FORMAT,
            "dataset": self.dataset_version(),
            "options": asdict(self.options),
            "epoch": self.epoch,
            "position": self.position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`, taken from a loader of the same dataset and options on any number of ranks."""
        self.check_state(state)
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._loaded = (self.epoch, self.position)

    def check_state(self, state: Any) -> None:
        """Refuse, in one line naming the difference, a state this loader cannot continue."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ResumeMismatchError(f"not a batchctl loader state (expected format {STATE_FORMAT!r})")
        ours, theirs = self.dataset_version(), state.get("dataset")
        if theirs != ours:
            raise ResumeMismatchError(
                f"the state is of another version of the dataset (saved: {theirs}, {self.dataset.path}: {ours});"
                " start the epoch over with a fresh loader"
            )
        saved = state.get("options")
        if not isinstance(saved, dict):
            raise ResumeMismatchError("the state has no loader options")
        for name, value in asdict(self.options).items():
            if saved.get(name) != value:
                raise ResumeMismatchError(
                    f"the state was saved with {name}={saved.get(name)!r}, this loader has {name}={value!r}"
                )
        epoch, position = state.get("epoch"), state.get("position")
        if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63 for v in (epoch, position)):
            raise ResumeMismatchError(f"the state's epoch and position are not ints >= 0: {epoch!r}, {position!r}")
        total = epoch_batches(self.dataset.num_samples, self.options)
        if position and position >= total:
            raise ResumeMismatchError(
                f"the state's position {position} lies past the end of the epoch ({total} batches of "
                f"{self.options.batch_size} on {self.dataset.num_samples} samples): it is not a state of this loader"
            )

    def dataset_version(self) -> dict[str, Any]:
        """The dataset's version, and which of its rows are read (a state of another subset is refused)."""
        version: dict[str, Any] = {"build_id": self.dataset.build_id, "num_samples": self.dataset.num_samples}
        if self.dataset.selected is not None:
            version["subset"] = hashlib.sha256(self.dataset.selected.astype("<i8").tobytes()).hexdigest()[:16]
        return version


def _read(dataset: BatchSource, order: EpochOrder, batches: Iterable[int], prefetch: int) -> Iterator[Batch]:
    """Read and cut output batches. The groups the current output batch takes rows from are held,
    and whole groups more are read ahead until `prefetch` stored batches are, in a thread pool
    (up to one thread per core): reading, checksums and zstd release the GIL, so they overlap one
    another and the caller's step."""
    wanted = list(batches)
    if not wanted:
        return
    # one thread per core for local reads (they need a core each); from an object store, one per
    # stored batch read ahead: each waits on the network, so `prefetch` of them are in flight
    threads = max(1, prefetch if dataset.remote else min(prefetch, len(os.sched_getaffinity(0))))
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="batchctl-read")
    try:
        reads = _GroupReads(dataset, order, pool, set(wanted))
        held: deque[_Group] = deque()  # in the order they are needed
        upcoming = _group_visits(order, wanted)
        for batch in wanted:
            groups = order.groups_of(batch)
            needs = len(groups)
            while held and held[0].group != groups[0]:
                held.popleft()  # groups before this batch's first are done with
            while len(held) < needs:
                held.append(reads.start(next(upcoming)))
            ahead = sum(len(g.reads) for g in list(held)[needs:])
            for group in upcoming if ahead < prefetch else ():
                held.append(reads.start(group))
                ahead += len(held[-1].reads)
                if ahead >= prefetch:
                    break
            yield reads.cut(batch, {g.group: g for g in list(held)[:needs]})
    finally:  # a pass left part way: the reads not begun are dropped, not waited for
        pool.shutdown(wait=True, cancel_futures=True)


@dataclass
class _Group:
    group: int
    reads: list[Future[Batch]]  # per stored batch, in visit order: the batch, or its `source` rows when scattered
    sources: np.ndarray | None = None  # the group's `source` rows in visit order, once joined


_ROW_BY_ROW = 4096  # bytes: rows at least this big are read straight into their output batch


class _GroupReads:
    """Starts a group's reads and cuts output batches from them.

    In stored order (no shuffle, `mix=1`) an output batch is a view of its stored batch or a few
    slices joined. With rows permuted, every output batch the group feeds is made as the group's
    reads start, and each stored batch is read straight into the places its rows go: an
    uncompressed chunk by one preadv into the rows of the output batches, others decoded and
    then copied. Rows of output batches this rank (or worker) does not take are read into a
    thread's scratch buffer: the checksum covers the whole chunk."""

    def __init__(self, dataset: BatchSource, order: EpochOrder, pool: ThreadPoolExecutor, wanted: set[int]) -> None:
        self.dataset, self.order, self.pool, self.wanted = dataset, order, pool, wanted
        self.numeric = {name: field for name, field in dataset.fields.items() if name != SOURCE}
        self.outputs: dict[int, Batch] = {}  # output batches being filled
        self.local = threading.local()

    def start(self, group: int) -> _Group:
        stored = [int(s) for s in self.order.stored_of_group(group)]
        if not self.order.permute:
            return _Group(group, [self.pool.submit(self.dataset.__getitem__, s) for s in stored])
        targets = self._targets(group)
        size = self.order.stored_batch
        return _Group(
            group,
            [
                self.pool.submit(
                    self._scatter, s, targets[0][k * size : (k + 1) * size], targets[1][k * size : (k + 1) * size]
                )
                for k, s in enumerate(stored)
            ],
        )

    def _targets(self, group: int) -> tuple[np.ndarray, np.ndarray]:
        """For each row of the group's stored batches laid end to end: its output batch (-1 for
        a row no output batch takes here) and its place there. The output batches are made."""
        order, size = self.order, self.order.options.batch_size
        rows = order.group_rows(group)
        batch, place = np.divmod(int(order.group_start[group]) + np.arange(len(rows)), size)
        taken = np.isin(batch, list(self.wanted & set(np.unique(batch).tolist())))
        target_batch = np.full(len(order.stored_of_group(group)) * order.stored_batch, -1, dtype=np.int64)
        target_place = np.zeros_like(target_batch)
        layout = order.in_group(rows)
        target_batch[layout[taken]], target_place[layout[taken]] = batch[taken], place[taken]
        for j in np.unique(batch[taken]).tolist():
            if j not in self.outputs:
                length = min(size, order.num_samples - j * size)
                self.outputs[j] = {
                    name: np.empty((length, *shape), dtype) for name, (shape, dtype) in self.numeric.items()
                }
        return target_batch, target_place

    def _scatter(self, stored: int, batch: np.ndarray, place: np.ndarray) -> Batch:
        """Stored batch `stored` into its rows' places (row r to output batch batch[r], place[r]):
        big rows read straight into them, small ones (labels) read whole and then placed."""
        taken = np.flatnonzero(batch >= 0)
        outputs = {
            name: [self.outputs[int(j)][name] if j >= 0 else None for j in batch.tolist()] for name in self.numeric
        }
        into = {}
        for name, (shape, dtype) in self.numeric.items():
            if np.dtype(dtype).itemsize * int(np.prod(shape)) >= _ROW_BY_ROW:
                scratch = self._scratch(name, (len(batch), *shape), dtype)
                into[name] = [
                    out[p] if out is not None else scratch[r]
                    for r, (out, p) in enumerate(zip(outputs[name], place.tolist(), strict=True))
                ]
        whole = self.dataset.read_batch(stored, into, [name for name in self.dataset.fields if name not in into])
        for name in self.numeric.keys() - into.keys():
            for r in taken.tolist():
                cast(np.ndarray, outputs[name][r])[place[r]] = whole[name][r]
        return {SOURCE: whole[SOURCE]} if SOURCE in whole else {}

    def _scratch(self, name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """This thread's buffer for the rows of a field no output batch here takes (reused)."""
        scratch: dict[str, np.ndarray] = self.local.__dict__.setdefault("scratch", {})
        if name not in scratch:
            scratch[name] = np.empty(shape, dtype)
        return scratch[name]

    @staticmethod
    def _sources(group: _Group) -> np.ndarray:
        """The group's `source` rows in visit order (joined once its reads are done); with
        `source` not among the fields read, an empty array once the reads are done."""
        if group.sources is None:
            done = [read.result() for read in group.reads]
            group.sources = np.concatenate([got[SOURCE] for got in done]) if SOURCE in done[0] else np.empty(0)
        return group.sources

    def cut(self, batch: int, groups: dict[int, _Group]) -> Batch:
        if not self.order.permute:
            stored = {
                s: f.result()
                for g in groups.values()
                for s, f in zip(self.order.stored_of_group(g.group).tolist(), g.reads, strict=True)
            }
            return gather(stored, self.order.rows(batch), self.order.stored_batch)
        parts = self.order.parts(batch)
        sources = [self._sources(groups[group]) for group, _ in parts]  # every read of the batch's groups done
        out = self.outputs.pop(batch)
        if SOURCE in self.dataset.fields:
            placed = [found[self.order.in_group(rows)] for found, (_, rows) in zip(sources, parts, strict=True)]
            out[SOURCE] = np.concatenate(placed) if len(placed) > 1 else placed[0]
        return {name: out[name] for name in self.dataset.fields}


def _group_visits(order: EpochOrder, batches: list[int]) -> Iterator[int]:
    """The groups the output batches need, in need order, each once per run of batches needing it."""
    last = None
    for batch in batches:
        for group in order.groups_of(batch):
            if group != last:
                yield group
                last = group
