"""An epoch's order: which rows make output batch j, and which consumer reads which stored batches.

Pure: NumPy and the options, no dataset, no files. `Loader` and `batchctl.torch` both use it.

The order is a function of (seed, epoch, the rows read, batch_size, mix, drop_last, partitions)
only. An epoch's stored batches are dealt into `partitions` disjoint shares (with `shuffle`,
stratified: each share holds stored batches from across the whole dataset; without, a run of
consecutive ones). Each share is ordered on its own as one dataset would be: its stored batches
visited `mix` at a time (`_visit_order`), each group's rows permuted together, the groups' rows
one after another, cut into output batches of `batch_size`. Output batch j is share j %
partitions's batch j // partitions. A consumer (rank x DataLoader worker) count P that divides
`partitions` takes batches j = k (mod P): whole shares, so each stored batch is read by one
consumer only, and the order is the same for every P in that family.

Every share yields as many batches: with `drop_last` the fewest any share makes (each share's
short last batch and its extra rows are left out), without it the most, a share with fewer
repeating its own first batches (read again) as `DistributedSampler` pads. With one share this
is the order of a single loader: the short last batch is the epoch's last.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from batchctl.errors import UsageError


@dataclass(frozen=True)
class OrderOptions:
    """What an epoch's order depends on besides the dataset and the epoch (a resume state must match)."""

    batch_size: int
    shuffle: bool
    seed: int
    mix: int
    drop_last: bool
    partitions: int = 1  # disjoint shares: any consumer count dividing it reads each byte once

    def checked(self) -> OrderOptions:
        """These options with plain ints (a NumPy int would not go into a JSON state), or a UsageError."""
        for name, least in (("batch_size", 1), ("mix", 1), ("seed", 0), ("partitions", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
                raise UsageError(f"Expected {name} to be an int >= {least}, got {value!r} instead.")
        return OrderOptions(
            int(self.batch_size),
            bool(self.shuffle),
            int(self.seed),
            int(self.mix),
            bool(self.drop_last),
            int(self.partitions),
        )


class EpochOrder:
    """One epoch's output batches, as global row indices, and the groups of stored batches they come from.

    Groups are numbered share by share (the groups of share 0, then of share 1, ...). A batch a
    share repeats to fill the last rounds comes from the same groups read again: a group key
    `cycle * groups + group` names the group's `cycle`-th reading. Nothing of size num_samples
    is built: a group's row permutation is made when a batch of it is asked for.
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
        """`num_samples` rows read of a dataset of `stored_rows` (default: as many) in stored
        batches of `stored_batch`; `selected`: a subset's rows (sorted global indices), of which
        only the stored batches holding them are visited."""
        self.num_samples, self.stored_batch, self.options, self.epoch = num_samples, stored_batch, options, epoch
        self.selected = selected
        stored = -(-(num_samples if stored_rows is None else stored_rows) // stored_batch)
        if selected is None:
            lengths = np.full(stored, stored_batch, dtype=np.int64)
            if stored:
                lengths[-1] = num_samples - (stored - 1) * stored_batch
        else:
            lengths = np.bincount(selected // stored_batch, minlength=stored).astype(np.int64)
        # a short last stored batch is visited last in its share: the others' rows then line up
        # with output batches of the stored size (at mix=1, the stored batches themselves)
        short = stored - 1 if selected is None and stored and lengths[-1] < stored_batch else -1
        rng = np.random.default_rng([options.seed, epoch])
        shares = _deal(np.flatnonzero(lengths), options.partitions, options.shuffle, rng)
        self.partitions = options.partitions
        visits, starts, owner, at = [], [], [], 0
        for p, share in enumerate(shares):  # one share is ordered as a single loader's epoch was before shares
            share_rng = rng if len(shares) == 1 else np.random.default_rng([options.seed, epoch, 2, p])
            visit, group = _share_visit(share, short, options, share_rng)
            visits.append(visit)
            starts.append(np.arange(at, at + len(visit), group, dtype=np.int64))
            owner.append(np.full(len(starts[-1]), p, dtype=np.int64))
            at += len(visit)
        self.visit = np.concatenate(visits).astype(np.int64)
        self.bounds = np.append(np.concatenate(starts), at)  # group g: visit[bounds[g]:bounds[g + 1]]
        self.groups = len(self.bounds) - 1
        self.owner = np.concatenate(owner)  # each group's share, ascending
        sizes = np.add.reduceat(lengths[self.visit], self.bounds[:-1]) if self.groups else np.zeros(0, np.int64)
        self.first_group = np.searchsorted(self.owner, np.arange(self.partitions + 1))  # share p: groups [p], [p+1]
        start = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.offset = start[:-1] - start[self.first_group[self.owner]]  # a group's first row within its share
        self.share_rows = start[self.first_group[1:]] - start[self.first_group[:-1]]
        size = options.batch_size
        made = self.share_rows // size if options.drop_last else -(-self.share_rows // size)
        self.share_batches = made  # each share's own batches, before the rounds are evened out
        self.steps = int(made.min() if options.drop_last else made.max()) if len(made) else 0
        if not options.drop_last and len(made) and made.min() == 0:
            self.steps = 0  # a share with no rows has nothing to repeat: refused as an empty epoch
        self.batches = self.steps * self.partitions  # all consumers together
        self.slot = np.zeros(stored, dtype=np.int64)  # each visited stored batch's place in its group
        self.slot[self.visit] = np.arange(len(self.visit)) - np.repeat(self.bounds[:-1], np.diff(self.bounds))
        self.permute = options.shuffle and options.mix > 1
        self._rows: OrderedDict[int, np.ndarray] = OrderedDict()

    def stored_of_group(self, key: int) -> np.ndarray:
        group = key % self.groups
        return self.visit[self.bounds[group] : self.bounds[group + 1]]

    def group_rows(self, key: int) -> np.ndarray:
        """The group's global row indices in epoch order (recent groups are kept)."""
        group = key % self.groups
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
            if len(self._rows) > 64:
                self._rows.popitem(last=False)
        return rows

    def _place(self, batch: int) -> tuple[int, int, int]:
        """Output batch `batch` as (share, the share's own batch it is, which reading of it)."""
        if not 0 <= batch < self.batches:
            raise IndexError(f"output batch {batch} out of range: the epoch has {self.batches}")
        share, step = batch % self.partitions, batch // self.partitions
        made = int(self.share_batches[share])
        return (share, step, 0) if step < made else (share, (step - made) % made, 1 + (step - made) // made)

    def _span(self, batch: int) -> tuple[int, int, int, int]:
        """(share, first row, end row within the share's rows, reading)."""
        share, own, cycle = self._place(batch)
        start = own * self.options.batch_size
        return share, start, min(start + self.options.batch_size, int(self.share_rows[share])), cycle

    def groups_of(self, batch: int) -> list[int]:
        """The keys of the groups output batch `batch` takes rows from, in epoch order."""
        share, start, stop, cycle = self._span(batch)
        lo, hi = int(self.first_group[share]), int(self.first_group[share + 1])
        offsets = self.offset[lo:hi]
        first = lo + int(np.searchsorted(offsets, start, side="right")) - 1
        last = lo + int(np.searchsorted(offsets, stop - 1, side="right")) - 1
        return [cycle * self.groups + g for g in range(first, last + 1)]

    def parts(self, batch: int) -> list[tuple[int, np.ndarray]]:
        """Output batch `batch` as (group key, its global row indices) for each group it takes rows from."""
        _, start, stop, _ = self._span(batch)
        parts = []
        for key in self.groups_of(batch):
            base = int(self.offset[key % self.groups])
            parts.append((key, self.group_rows(key)[max(start - base, 0) : stop - base]))
        return parts

    def rows(self, batch: int) -> np.ndarray:
        """Global row indices of output batch `batch`, in order."""
        parts = [rows for _, rows in self.parts(batch)]
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def length(self, batch: int) -> int:
        _, start, stop, _ = self._span(batch)
        return stop - start

    def targets(self, key: int) -> tuple[np.ndarray, np.ndarray]:
        """For each of the group's rows (in `group_rows` order): the output batch it goes to in
        this reading (-1: none, a row `drop_last` leaves out) and its place there."""
        group, cycle = key % self.groups, key // self.groups
        share = int(self.owner[group])
        offsets = int(self.offset[group]) + np.arange(len(self.group_rows(key)))
        own, place = np.divmod(offsets, self.options.batch_size)
        made = int(self.share_batches[share])
        step = own + cycle * made
        taken = (step < self.steps) & (own < made)
        return np.where(taken, step * self.partitions + share, -1), place

    def in_group(self, rows: np.ndarray) -> np.ndarray:
        """Where global rows lie in their group's stored batches laid end to end in visit order."""
        stored, row = np.divmod(rows, self.stored_batch)
        return self.slot[stored] * self.stored_batch + row

    def stored_read_by(self, consumer: int, consumers: int) -> np.ndarray:
        """The stored batches consumer `consumer` of `consumers` (a divisor of the partitions) reads in the epoch."""
        shares = range(consumer, self.partitions, consumers)
        return np.concatenate(
            [self.visit[self.bounds[self.first_group[p]] : self.bounds[self.first_group[p + 1]]] for p in shares]
            or [np.zeros(0, np.int64)]
        )


def _deal(present: np.ndarray, partitions: int, shuffle: bool, rng: np.random.Generator) -> list[np.ndarray]:
    """The stored batches of each share, in stored order. Shuffled, each run of `partitions`
    consecutive stored batches gives one to each of as many shares, at random: a share spans the
    dataset (every class of a sorted build), and shares differ by one stored batch at most."""
    if partitions == 1:
        return [present]
    if not shuffle:
        return list(np.array_split(present, partitions))
    runs = -(-len(present) // partitions)
    share_of = np.argsort(rng.random((runs, partitions)), axis=1).reshape(-1)[: len(present)]
    return [present[share_of == p] for p in range(partitions)]


def _share_visit(
    share: np.ndarray, short: int, options: OrderOptions, rng: np.random.Generator
) -> tuple[np.ndarray, int]:
    """A share's stored batches in visit order, and how many make a group."""
    if not options.shuffle:
        return share, 1
    full = share[share != short]
    found, group = _visit_order(len(full), options.mix, rng)
    visit = full[found]
    return (np.append(visit, short), group) if len(full) < len(share) else (visit, group)


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


def check_rank(rank: int, world_size: int) -> None:
    """A UsageError unless `world_size` is a positive int and `rank` one of its ranks."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise UsageError(f"Expected world_size to be a positive int, got {world_size!r} instead.")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise UsageError(f"Expected 0 <= rank < world_size, got rank {rank!r}, world_size {world_size} instead.")


def rank_batches(total: int, position: int, rank: int, world_size: int, drop_last: bool) -> Sequence[int]:
    """The output batches rank `rank` takes from `position` on (a position counts the batches all
    ranks together have taken: it is the same number on every rank)."""
    left = max(total - position, 0)
    if drop_last:
        return range(position + rank, position + (left // world_size) * world_size, world_size)
    steps = math.ceil(left / world_size)
    return [(position + t * world_size + rank) % total for t in range(steps)] if total else []


def consumer_steps(
    total: int, position: int, rank: int, world_size: int, drop_last: bool, worker: int, workers: int
) -> Sequence[int]:
    """The output batches DataLoader worker `worker` of `workers` on rank `rank` takes from
    `position` on: its rank's steps `worker`, `worker + workers`, ... (the DataLoader hands
    them out in turn, so the rank sees the same order whatever `workers` is)."""
    return rank_batches(total, position, rank, world_size, drop_last)[worker::workers]


def family_problem(partitions: int, world_size: int, workers: int = 1) -> str | None:
    """Why `world_size` ranks of `workers` DataLoader workers each cannot read an order of
    `partitions` shares once each (None: they can)."""
    consumers = world_size * workers
    if partitions % consumers == 0:
        return None
    fits = [n for n in range(1, partitions + 1) if partitions % n == 0]
    return (
        f"the order is cut into {partitions} partitions, which {world_size} ranks x {workers} DataLoader workers "
        f"({consumers} consumers) do not divide: use a consumer count among {fits}, or start the run with "
        f"partitions= a multiple of every count you will use (12 fits 1, 2, 3, 4, 6 and 12)"
    )
