"""Every epoch complete, whatever the partitions: the rows each consumer is given, counted.

On a real dataset (2,400 numbered rows in 38 stored batches of 64, built by the CLI), every rank
x DataLoader worker of an epoch reads its share as `IterableBatches` does (its rank's steps
`worker`, `worker + workers`, ...), and the rows all of them are given are checked against what
torch's `DistributedSampler` + `DataLoader` give: with drop_last, fewer than world_size x
batch_size rows left out and none when the rows divide; without, every row once, the lockstep
padding at most world_size - 1 batches (`Loader.padding`).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

import batchctl
from tests.conftest import run_cli
from tests.test_loader import ids, make_numbered

ROWS, STORED = 2400, 64


@pytest.fixture(scope="module")
def rows2400(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("epoch")
    make_numbered(root / "src", 0, ROWS, 5)
    out = root / "rows.zarr"
    args = ("--preprocess", "npy", "--batch-size", STORED, "--compression", "none")
    result = run_cli("build", root / "src", "-o", out, *args)
    assert result.returncode == 0, result.stderr
    return out


def epoch_rows(
    path: Path, epoch: int, partitions: int | None, world: int, workers: int, **options: object
) -> tuple[list[int], int]:
    """Every row all consumers are given in `epoch` (in no order), and the padding counted."""
    ds = batchctl.open(path)
    given: list[int] = []
    padding = 0
    for rank in range(world):
        loader = ds.loader(rank=rank, world_size=world, partitions=partitions, **options)  # type: ignore[arg-type]
        loader.set_epoch(epoch)
        padding = loader.padding
        steps = [loader.batches(worker=w, workers=workers) for w in range(workers)]
        assert len({len(s) for s in steps}) <= 2  # workers' shares differ by one step at most
        for share in steps:
            given += [n for batch in loader.read_steps(epoch, share) for n in ids(batch)]
    return given, padding


# (partitions, world size): the issue table's (None: one per rank x worker), and other families
LAYOUTS = [(None, 1), (None, 4), (None, 8), (12, 4), (12, 1), (24, 4), (24, 8), (12, 3)]


@pytest.mark.parametrize(("partitions", "world"), LAYOUTS)
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("batch_size", [50, 64, 7])
def test_an_epoch_gives_every_row_once_whatever_the_partitions(
    rows2400: Path, partitions: int | None, world: int, workers: int, drop_last: bool, batch_size: int
) -> None:
    shares = world * workers if partitions is None else partitions
    if shares % (world * workers):
        pytest.skip("outside the family")
    options = dict(batch_size=batch_size, mix=16, seed=3, drop_last=drop_last)
    given, padding = epoch_rows(rows2400, 0, shares, world, workers, **options)
    counts = Counter(given)
    assert set(counts) <= set(range(ROWS))
    if drop_last:
        assert max(counts.values()) == 1  # never twice
        left_out = ROWS - len(given)
        assert 0 <= left_out < world * batch_size  # as DistributedSampler + DataLoader(drop_last=True)
        whole = ROWS // batch_size  # the short last batch, and the last round the ranks cannot share, left out
        assert left_out == ROWS - (whole - whole % world) * batch_size
        if ROWS % (world * batch_size) == 0:
            assert left_out == 0
        assert padding == 0
        if left_out:  # the rows left out change every epoch
            again, _ = epoch_rows(rows2400, 1, shares, world, workers, **options)
            assert set(range(ROWS)) - set(again) != set(range(ROWS)) - set(given)
    else:
        assert set(counts) == set(range(ROWS))  # every row
        assert len(given) == ROWS + padding  # once, but the lockstep padding
        assert padding <= (world - 1) * batch_size
        assert sum(c - 1 for c in counts.values()) == padding
        if world == 1:
            assert padding == 0


def test_the_readmes_example_and_its_family_give_one_order(rows2400: Path) -> None:
    """partitions=12: the same rows in the same batches for 1, 2, 3, 4, 6 and 12 ranks."""
    ds = batchctl.open(rows2400)
    orders = {}
    for world in (1, 2, 3, 4, 6, 12):
        loaders = [ds.loader(batch_size=50, rank=r, world_size=world, partitions=12) for r in range(world)]
        steps = [[ids(b) for b in loader] for loader in loaders]
        orders[world] = [steps[t % world][t // world] for t in range(sum(map(len, steps)))]
    first = orders[1]
    assert len(first) == ROWS // 50 and len({n for b in first for n in b}) == ROWS
    assert all(order == first for order in orders.values())


def test_iterable_batches_in_dataloader_workers_gives_a_small_dataset_once(tmp_path: Path) -> None:
    """36 rows, a DataLoader of 2 workers: 36 rows, each once (drop_last=False), and 32 with
    drop_last (the short batch of 4 left out), epoch after epoch."""
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from batchctl.torch import IterableBatches

    make_numbered(tmp_path / "src", 0, 36, 5)
    out = tmp_path / "small.zarr"
    result = run_cli("build", tmp_path / "src", "-o", out, "--preprocess", "npy", "--batch-size", "8")
    assert result.returncode == 0, result.stderr
    for drop_last, want in ((False, 36), (True, 32)):
        stream = IterableBatches(out, batch_size=8, drop_last=drop_last)
        loader = DataLoader(stream, batch_size=None, num_workers=2, persistent_workers=True)
        for _ in range(2):
            given = [n for batch in loader for n in ids(batch)]
            assert len(given) == len(set(given)) == want


def test_a_state_of_the_earlier_partitioned_order_is_refused_in_one_line(rows2400: Path) -> None:
    """Before this order, a position in an order of several partitions meant other rows."""
    ds = batchctl.open(rows2400)
    loader = ds.loader(batch_size=50, partitions=4)
    next(iter(loader))
    state = loader.state_dict()
    earlier = {name: value for name, value in state.items() if name != "order"}
    with pytest.raises(batchctl.ResumeMismatchError, match="saved by an earlier batchctl") as refused:
        ds.loader(batch_size=50).load_state_dict(earlier)
    assert "\n" not in str(refused.value)
    ds.loader(batch_size=50).load_state_dict(state)  # this order's own state resumes
    single = ds.loader(batch_size=50)
    next(iter(single))
    unchanged = {name: value for name, value in single.state_dict().items() if name != "order"}
    ds.loader(batch_size=50).load_state_dict(unchanged)  # one partition's order is the one it was
