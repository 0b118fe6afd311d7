"""An epoch's order: which rows make output batch j, and which consumer reads which stored batches.

Pure: NumPy and the options, no dataset, no files. `Loader` and `batchctl.torch` both use it.

The order is a function of (seed, epoch, the rows read, batch_size, mix, drop_last, partitions)
only. An epoch's stored batches are dealt into `partitions` disjoint shares (with `shuffle`,
stratified: each share holds stored batches from across the whole dataset; without, a run of
consecutive ones). Each share is ordered on its own as one dataset would be: its stored batches
visited `mix` at a time (`_visit_order`), each group's rows permuted together. The shares' rows,
laid end to end, are then cut again into shares exactly as long as their output batches: the
epoch's rows make ceil(rows / batch_size) output batches (the last one short), output batch j is
share j % partitions's batch j // partitions, and share p holds the rows of its batches, so no
row is left out or repeated whatever `partitions` is. A cut may split a stored batch between two
neighbouring shares (both read it: at most partitions - 1 extra reads an epoch).

A consumer (rank x DataLoader worker) count C that divides `partitions` takes batches j = k
(mod C): whole shares, so each stored batch is read by one consumer only (but for those split),
and the order is the same for every C in that family. `drop_last` leaves out the short last
batch, and `rank_batches` the last rounds that the ranks cannot share evenly: fewer than
world_size x batch_size rows, none when the rows divide it. Without `drop_last` the last round
is filled from the epoch's first batches (read again), as `DistributedSampler` pads: at most
world_size - 1 batches repeated (`padding_rows`). With one share this is the order of a single
loader: the short last batch is the epoch's last.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from batchctl.errors import UsageError

# a resume state says which order it is a position in: before 2, the shares of partitions > 1 were
# cut at stored batches (and evened out by leaving rows out or repeating them), so a position of
# an earlier state means other rows
ORDER_VERSION = 2


def earlier_order_problem(state: dict[str, Any], partitions: int) -> str | None:
    """Why a resume state saved under an earlier order cannot be continued (None: it can)."""
    if state.get("order", 1) == ORDER_VERSION or partitions == 1:  # one partition's order is unchanged
        return None
    return (
        f"the state was saved by an earlier batchctl, whose order of {partitions} partitions took other rows: "
        "start the epoch over (set_epoch) with a fresh loader"
    )


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
    """One epoch's output batches, as global row indices, and the groups of stored rows they come from.

    The shares' visits laid end to end are cut again by rows, so that share p holds exactly the
    rows of its output batches p, p + partitions, ...: no share is short of rows, so none is left
    out and none repeated. A cut may fall inside a stored batch; its rows on each side go to the
    two shares, and both read it (at most partitions - 1 extra stored-batch reads an epoch). A
    group is one share's part of a dealt group: pieces (stored batch, first row, end row), rows
    numbered within the rows read of that stored batch, permuted together. Groups are numbered
    share by share. Nothing of size num_samples is built: a group's rows are made when asked for.
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
        self.partitions = partitions = options.partitions
        lengths, short = _stored_lengths(num_samples, stored_batch, selected, stored_rows)
        self.visit, dealt_group = _dealt_visit(lengths, short, options, epoch)
        size = options.batch_size
        self.share_batches, self.share_rows = share_layout(num_samples, size, partitions)
        made = int(self.share_batches.sum())  # output batches, a short last one included
        last = (made - 1) % partitions  # the share whose last batch is the epoch's last
        self.batches = num_samples // size if options.drop_last else made  # all consumers together
        # the stream is cut with the share of the short last batch at its end, where the short
        # stored batch lies: the other shares then start on stored batches (when the sizes agree)
        cuts = _cut(lengths[self.visit], self.share_rows, [p for p in range(partitions) if p != last] + [last])
        stored, lo, hi, firsts, owner, count = [], [], [], [], [], 0
        for p, (index, first, end) in enumerate(cuts):
            starts = np.flatnonzero(np.diff(dealt_group[index], prepend=-1))  # a dealt group's first piece here
            stored.append(self.visit[index])
            lo.append(first)
            hi.append(end)
            firsts.append(count + starts)
            owner.append(np.full(len(starts), p, dtype=np.int64))
            count += len(index)
        self.piece_stored, self.piece_lo, self.piece_hi = (np.concatenate(a).astype(np.int64) for a in (stored, lo, hi))
        self.bounds = np.append(np.concatenate(firsts), count).astype(np.int64)  # group g: pieces [g], [g+1]
        self.groups = len(self.bounds) - 1
        self.owner = np.concatenate(owner)  # each group's share, ascending
        pieces = self.piece_hi - self.piece_lo
        sizes = np.add.reduceat(pieces, self.bounds[:-1]) if self.groups else np.zeros(0, np.int64)
        self.first_group = np.searchsorted(self.owner, np.arange(partitions + 1))  # share p: groups [p], [p+1]
        start = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.offset = start[:-1] - start[self.first_group[self.owner]]  # a group's first row within its share
        self.permute = options.shuffle and options.mix > 1
        self._rows: OrderedDict[int, np.ndarray] = OrderedDict()

    def stored_of_group(self, group: int) -> np.ndarray:
        return self.piece_stored[self.bounds[group] : self.bounds[group + 1]]

    def group_rows(self, group: int) -> np.ndarray:
        """The group's global row indices in epoch order (recent groups are kept)."""
        rows = self._rows.get(group)
        if rows is None:
            size, selected, at = self.stored_batch, self.selected, slice(self.bounds[group], self.bounds[group + 1])
            ranges = []
            for s, lo, hi in zip(self.piece_stored[at], self.piece_lo[at], self.piece_hi[at], strict=True):
                if selected is None:
                    ranges.append(np.arange(s * size + lo, s * size + hi))
                else:
                    base = int(np.searchsorted(selected, s * size))
                    ranges.append(selected[base + lo : base + hi])
            rows = np.concatenate(ranges)
            if self.permute:
                rows = np.random.default_rng([self.options.seed, self.epoch, 1, group]).permutation(rows)
            self._rows[group] = rows
            if len(self._rows) > 64:
                self._rows.popitem(last=False)
        return rows

    def _span(self, batch: int) -> tuple[int, int, int]:
        """Output batch `batch` as (its share, its first row, its end row within the share's rows)."""
        if not 0 <= batch < self.batches:
            raise IndexError(f"output batch {batch} out of range: the epoch has {self.batches}")
        share, own = batch % self.partitions, batch // self.partitions
        start = own * self.options.batch_size
        return share, start, min(start + self.options.batch_size, int(self.share_rows[share]))

    def groups_of(self, batch: int) -> list[int]:
        """The groups output batch `batch` takes rows from, in epoch order."""
        share, start, stop = self._span(batch)
        lo, hi = int(self.first_group[share]), int(self.first_group[share + 1])
        offsets = self.offset[lo:hi]
        first = lo + int(np.searchsorted(offsets, start, side="right")) - 1
        last = lo + int(np.searchsorted(offsets, stop - 1, side="right")) - 1
        return list(range(first, last + 1))

    def parts(self, batch: int) -> list[tuple[int, np.ndarray]]:
        """Output batch `batch` as (group, its global row indices) for each group it takes rows from."""
        _, start, stop = self._span(batch)
        parts = []
        for group in self.groups_of(batch):
            base = int(self.offset[group])
            parts.append((group, self.group_rows(group)[max(start - base, 0) : stop - base]))
        return parts

    def rows(self, batch: int) -> np.ndarray:
        """Global row indices of output batch `batch`, in order."""
        parts = [rows for _, rows in self.parts(batch)]
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def length(self, batch: int) -> int:
        _, start, stop = self._span(batch)
        return stop - start

    def targets(self, group: int) -> tuple[np.ndarray, np.ndarray]:
        """For each of the group's rows (in `group_rows` order): the output batch it goes to (-1:
        none, the short last batch `drop_last` leaves out) and its place there."""
        offsets = int(self.offset[group]) + np.arange(len(self.group_rows(group)))
        own, place = np.divmod(offsets, self.options.batch_size)
        batch = own * self.partitions + int(self.owner[group])
        return np.where(batch < self.batches, batch, -1), place

    def in_group(self, rows: np.ndarray, group: int) -> np.ndarray:
        """Where global rows lie in the group's stored batches laid end to end in visit order."""
        stored, row = np.divmod(rows, self.stored_batch)
        mine = self.stored_of_group(group)
        sorter = np.argsort(mine)
        return sorter[np.searchsorted(mine, stored, sorter=sorter)] * self.stored_batch + row

    def stored_read_by(self, consumer: int, consumers: int) -> np.ndarray:
        """The stored batches consumer `consumer` of `consumers` (a divisor of the partitions) reads in the epoch."""
        pieces = [
            self.piece_stored[self.bounds[self.first_group[p]] : self.bounds[self.first_group[p + 1]]]
            for p in range(consumer, self.partitions, consumers)
        ]
        return np.unique(np.concatenate(pieces or [np.zeros(0, np.int64)]))


def share_layout(num_samples: int, batch_size: int, partitions: int) -> tuple[np.ndarray, np.ndarray]:
    """Each share's output batches and rows: the epoch's ceil(rows / batch_size) batches dealt
    j -> share j % partitions, the short last one's share shorter by what it lacks. The same for
    every epoch (a mixture's streams rely on it)."""
    made = -(-num_samples // batch_size)
    batches = np.array([len(range(p, made, partitions)) for p in range(partitions)], np.int64)
    rows = batches * batch_size
    if made:
        rows[(made - 1) % partitions] -= made * batch_size - num_samples
    return batches, rows


def _stored_lengths(
    num_samples: int, stored_batch: int, selected: np.ndarray | None, stored_rows: int | None
) -> tuple[np.ndarray, int]:
    """The rows read of each stored batch, and the short last one's number (-1: none is short)."""
    stored = -(-(num_samples if stored_rows is None else stored_rows) // stored_batch)
    if selected is not None:
        return np.bincount(selected // stored_batch, minlength=stored).astype(np.int64), -1
    lengths = np.full(stored, stored_batch, dtype=np.int64)
    if stored:
        lengths[-1] = num_samples - (stored - 1) * stored_batch
    # a short last stored batch is visited last: the others' rows then line up with output
    # batches of the stored size (at mix=1, the stored batches themselves)
    return lengths, stored - 1 if stored and lengths[-1] < stored_batch else -1


def _dealt_visit(lengths: np.ndarray, short: int, options: OrderOptions, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """The stored batches holding rows, dealt into the shares and each share visited in groups,
    the shares one after another; and each one's dealt group (numbered in that order)."""
    rng = np.random.default_rng([options.seed, epoch])
    present = np.flatnonzero(lengths)
    partitions = options.partitions
    if partitions > 1 and short >= 0:  # dealt last, to the last share
        present = present[present != short]
    shares = _deal(present, partitions, options.shuffle, rng)
    if partitions > 1 and short >= 0:
        shares[-1] = np.append(shares[-1], short)
    visits, groups, count = [], [], 0
    for p, share in enumerate(shares):  # one share is ordered as a single loader's epoch was before shares
        share_rng = rng if partitions == 1 else np.random.default_rng([options.seed, epoch, 2, p])
        visit, group = _share_visit(share, short, options, share_rng)
        visits.append(visit)
        groups.append(count + np.arange(len(visit)) // group)
        count += -(-len(visit) // group)
    return np.concatenate(visits).astype(np.int64), np.concatenate(groups).astype(np.int64)


Pieces = tuple[np.ndarray, np.ndarray, np.ndarray]  # visited stored batches (by index), first rows, end rows


def _cut(rows: np.ndarray, share_rows: np.ndarray, stream: list[int]) -> list[Pieces]:
    """Cut visited stored batches of `rows` rows each, laid end to end, into the shares of
    `share_rows` rows, the shares coming in `stream` order. For each share (by number): the
    visited batches it takes rows of (their index in the visit), and its first and end row in each."""
    ends = np.cumsum(rows)
    begins = ends - rows
    cuts: dict[int, Pieces] = {}
    at = 0
    for p in stream:
        a, b = at, at + int(share_rows[p])
        index = np.arange(np.searchsorted(ends, a, side="right"), np.searchsorted(begins, b, side="left"))
        cuts[p] = (index, np.maximum(a, begins[index]) - begins[index], np.minimum(b, ends[index]) - begins[index])
        at = b
    return [cuts[p] for p in range(len(share_rows))]


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


def padding_rows(order: EpochOrder, position: int, world_size: int) -> int:
    """Rows that `rank_batches` hands out twice from `position` on, all ranks together (without
    `drop_last`: the last round's batches filled from the epoch's first ones)."""
    if order.options.drop_last or not order.batches:
        return 0
    left = max(order.batches - position, 0)
    repeated = -(-left // world_size) * world_size - left
    return sum(order.length(j % order.batches) for j in range(repeated))


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
