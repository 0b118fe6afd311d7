"""The epoch's order on its own (`batchctl/read/order.py`): no dataset, no files.

What a trainer relies on: every row exactly once an epoch but at most the short last batch
(drop_last), whatever the partitions; each stored batch read by one consumer only for every
consumer count dividing the partitions (but the few a cut between two shares splits), one order
for all of them, and a position that resumes anywhere.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from batchctl.read.order import EpochOrder, OrderOptions, consumer_steps, family_problem, rank_batches

SHAPES = [(205, 8), (2400, 64), (1000, 10), (97, 7)]  # (rows, stored batch): short last ones included
OPTIONS = [
    dict(batch_size=5, shuffle=True, mix=16, drop_last=True),
    dict(batch_size=13, shuffle=True, mix=4, drop_last=False),
    dict(batch_size=20, shuffle=True, mix=1, drop_last=True),
    dict(batch_size=3, shuffle=False, mix=16, drop_last=False),
]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def test_frozen_values() -> None:
    """The order is part of a resume state's meaning: a change here changes what a saved state resumes to."""
    one = EpochOrder(20, 4, OrderOptions(3, True, 0, 2, True), 0)
    assert [one.rows(j).tolist() for j in range(one.batches)] == [
        [16, 9, 17], [11, 18, 19], [10, 8, 13], [3, 2, 1], [0, 14, 12], [15, 7, 5],
    ]  # fmt: skip
    two = EpochOrder(20, 4, OrderOptions(3, True, 0, 2, True, partitions=2), 0)
    assert [two.rows(j).tolist() for j in range(two.batches)] == [
        [6, 7, 5], [12, 15, 19], [9, 3, 2], [18, 13, 17], [1, 0, 10], [16, 14, 4],
    ]  # fmt: skip
    plain = EpochOrder(10, 4, OrderOptions(4, False, 0, 2, False, partitions=2), 0)
    # share 0 takes batches 0 and 2 (the short last one), so it comes last in the rows: 4 to 9
    assert [plain.rows(j).tolist() for j in range(plain.batches)] == [[4, 5, 6, 7], [0, 1, 2, 3], [8, 9]]


@pytest.mark.parametrize(("rows", "stored"), SHAPES)
@pytest.mark.parametrize("partitions", [1, 2, 3, 4, 12])
def test_every_consumer_count_dividing_the_partitions_reads_each_stored_batch_once(
    rows: int, stored: int, partitions: int
) -> None:
    for options, epoch in itertools.product(OPTIONS, (0, 3)):
        order = EpochOrder(rows, stored, OrderOptions(seed=1, partitions=partitions, **options), epoch)  # type: ignore[arg-type]
        if not order.batches:
            assert len(order.visit) < partitions or options["drop_last"]  # refused by the loader, in one line
            continue
        every = np.concatenate([order.rows(j) for j in range(order.batches)])
        assert len(np.unique(every)) == len(every)  # never twice
        size = options["batch_size"]
        if options["drop_last"]:  # only the short last batch is left out
            assert len(every) == order.batches * size == rows // size * size
        else:
            assert sorted(every.tolist()) == list(range(rows))  # every row once
        assert [order.length(j) for j in range(order.batches)][:-1] == [size] * (order.batches - 1)
        for consumers in divisors(partitions):
            read = [set(order.stored_read_by(k, consumers).tolist()) for k in range(consumers)]
            assert set().union(*read) == set(order.visit.tolist())  # all visited
            assert sum(map(len, read)) - len(set().union(*read)) <= partitions - 1  # but those split, once each
            for k in range(consumers):
                for j in range(k, order.batches, consumers):  # consumer k's batches
                    needed = {int(s) for key in order.groups_of(j) for s in order.stored_of_group(key)}
                    assert set((order.rows(j) // stored).tolist()) <= needed <= read[k]


def test_shares_span_the_dataset_and_hold_their_batches_rows() -> None:
    order = EpochOrder(41 * 8, 8, OrderOptions(8, True, 0, 4, True, partitions=4), 0)
    assert order.share_rows.tolist() == [88, 80, 80, 80]  # batches 0, 4, ..., 40 / 1, 5, ..., 37 / ...
    for k in range(4):  # of nearly every run of 4 consecutive stored batches: a class-sorted build's every class
        assert len(set((order.stored_read_by(k, 4) // 4).tolist())) >= 9


def test_a_group_feeds_exactly_its_rows_places() -> None:
    order = EpochOrder(205, 8, OrderOptions(6, True, 2, 4, False, partitions=3), 1)
    keys = {key for j in range(order.batches) for key in order.groups_of(j)}
    assert keys == set(range(order.groups))
    filled = {j: np.full(order.length(j), -1) for j in range(order.batches)}
    for key in keys:
        batch, place = order.targets(key)
        rows = order.group_rows(key)
        for row, j, p in zip(rows.tolist(), batch.tolist(), place.tolist(), strict=True):
            if j >= 0:
                assert filled[j][p] == -1
                filled[j][p] = row
    assert all((filled[j] == order.rows(j)).all() for j in range(order.batches))


def test_one_partition_is_a_single_loaders_order_with_the_short_batch_last() -> None:
    order = EpochOrder(205, 8, OrderOptions(8, True, 0, 1, False), 0)
    assert [len(order.rows(j)) for j in range(order.batches)] == [8] * 25 + [5]
    assert all(len(np.unique(order.rows(j) // 8)) == 1 for j in range(order.batches))  # mix=1: whole stored batches


@pytest.mark.parametrize("drop_last", [True, False])
def test_a_position_resumes_anywhere_on_any_world_size(drop_last: bool) -> None:
    total = 24
    for world, position in itertools.product((1, 2, 3, 4, 6), range(total)):
        taken = [j for r in range(world) for j in rank_batches(total, position, r, world, drop_last)]
        steps = {len(rank_batches(total, position, r, world, drop_last)) for r in range(world)}
        assert len(steps) == 1  # equal steps, as DDP needs
        left = set(range(position, total))
        if drop_last:
            assert set(taken) <= left and len(taken) == len(set(taken)) and len(left - set(taken)) < world
        else:
            assert set(taken) >= left  # the last round filled from the epoch's first batches


def test_dataloader_workers_split_a_ranks_steps_in_turn() -> None:
    rank = list(rank_batches(40, 4, 1, 2, True))
    split = [consumer_steps(40, 4, 1, 2, True, w, 3) for w in range(3)]
    # the DataLoader hands them out in turn: worker 0's first, worker 1's first, ...
    assert [split[t % 3][t // 3] for t in range(len(rank))] == rank


def test_a_consumer_count_outside_the_family_says_what_fits() -> None:
    assert family_problem(12, 3, 2) is None and family_problem(4, 2, 2) is None
    said = family_problem(4, 3)
    assert said is not None and "4 partitions" in said and "[1, 2, 4]" in said and "\n" not in said
    with pytest.raises(Exception, match="partitions to be an int >= 1"):
        OrderOptions(4, True, 0, 2, True, partitions=0).checked()
