"""Mixtures (`batchctl.mix`) of datasets built by the real CLI.

Two sources of numbered one-row .npy samples: `big` (samples 0-199) and `small` (1000-1059), so
a row says which source it came from and which sample it is, and is checked against its `source`.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import batchctl
from tests.conftest import run_cli
from tests.test_loader import make_numbered

BIG, SMALL = (0, 200), (1000, 60)


def _build(root: Path, name: str, start: int, count: int, width: int = 1024) -> Path:
    folder = root / name
    make_numbered(folder, start, count, 5)
    if width != 1024:  # rows of another shape
        for path in folder.rglob("*.npy"):
            np.save(path, np.full(width, int(path.stem[1:]), dtype=np.int32))
    out = root / f"{name}.zarr"
    args = ("--preprocess", "npy", "--batch-size", "4", "--compression", "none")  # 15 stored batches of small
    result = run_cli("build", folder, "-o", out, *args)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mixture")
    return {"big": _build(root, "big", *BIG), "small": _build(root, "small", *SMALL)}


def rows(batch: dict[str, Any]) -> list[int]:
    """The samples of a batch, each checked against its source path and its `dataset` index."""
    values = [int(v) for v in batch["array"][:, 0]]
    assert values == [int(str(s).rsplit("s", 1)[1].split(".")[0]) for s in batch["source"]]
    assert [int(d) for d in batch["dataset"]] == [int(v >= 1000) for v in values]
    return values


def opened(sources: dict[str, Path]) -> dict[str, Any]:
    return {name: batchctl.open(path) for name, path in sources.items()}


def epochs(loader: Any, count: int) -> list[list[list[int]]]:
    return [[rows(b) for b in loader] for _ in range(count)]


def test_every_batch_holds_the_weights_and_a_small_source_repeats_in_a_fresh_order(sources: dict[str, Path]) -> None:
    loader = batchctl.mix(opened(sources), {"big": 0.7, "small": 0.3}, batch_size=10, seed=1)
    assert loader.counts == [7, 3]
    first, second = epochs(loader, 2)
    for batch in first + second:
        assert Counter(v >= 1000 for v in batch) == {False: 7, True: 3}  # exact in every batch
    # the epoch: the largest-weighted source about once (200 rows // 7 a batch = 28 batches)
    assert len(first) == len(second) == 28
    big = [[v for b in epoch for v in b if v < 1000] for epoch in (first, second)]
    assert len(set(big[0])) == len(big[0]) == 196  # once each; the next epoch goes on where it stopped
    assert set(big[1][:4]) == set(range(200)) - set(big[0])  # the 4 left, then its next pass
    small = [v for epoch in (first, second) for b in epoch for v in b if v >= 1000]
    passes = [small[i : i + 60] for i in range(0, 120, 60)]  # 168 rows of a 60-row source
    assert all(sorted(p) == list(range(1000, 1060)) for p in passes)  # each pass every row once
    assert passes[0] != passes[1]  # in a fresh order
    again = batchctl.mix(opened(sources), {"big": 0.7, "small": 0.3}, batch_size=10, seed=1)
    assert epochs(again, 1)[0] == first  # a pure function of the options and the epoch
    sized = batchctl.mix(opened(sources), {"big": 1, "small": 1}, batch_size=10, epoch_size=55, seed=1)
    assert len(epochs(sized, 1)[0]) == 5  # 55 rows: 5 whole batches


def test_exact_resume_through_a_wrap_around_and_an_epoch_boundary(sources: dict[str, Path]) -> None:
    options: dict[str, Any] = {"batch_size": 10, "seed": 3, "mix": 4}
    weights = {"big": 0.6, "small": 0.4}
    expected = [b for epoch in epochs(batchctl.mix(opened(sources), weights, **options), 3) for b in epoch]
    rng = random.Random(5)
    for k in sorted({rng.randrange(1, len(expected)) for _ in range(4)} | {len(expected) // 3}):
        first = batchctl.mix(opened(sources), weights, **options)
        got: list[list[int]] = []
        while len(got) < k:
            for batch in first:
                got.append(rows(batch))
                if len(got) == k:
                    break
        state = json.loads(json.dumps(first.state_dict()))  # plain JSON
        second = batchctl.mix(opened(sources), weights, **options)
        second.load_state_dict(state)
        while len(got) < len(expected):
            got.extend(rows(b) for b in second)
        assert got == expected, k


@pytest.mark.parametrize(("old", "new"), [(4, 2), (2, 3)])
def test_elastic_resume_through_a_mixture(sources: dict[str, Path], old: int, new: int) -> None:
    options: dict[str, Any] = {"batch_size": 6, "seed": 2, "mix": 4, "partitions": 12}
    weights = {"big": 2, "small": 1}
    whole = epochs(batchctl.mix(opened(sources), weights, **options), 1)[0]
    states, taken = [], []
    for rank in range(old):
        loader = batchctl.mix(opened(sources), weights, rank=rank, world_size=old, **options)
        for step, batch in enumerate(loader, 1):
            taken.append(rows(batch))
            if step == 2:
                break
        states.append(loader.state_dict())
    assert all(s == states[0] for s in states)
    rest = []
    for rank in range(new):
        loader = batchctl.mix(opened(sources), weights, rank=rank, world_size=new, **options)
        loader.load_state_dict(json.loads(json.dumps(states[0])))
        rest.extend(rows(b) for b in loader)
    # together: the one order's batches, each once, but for the last (total - 2 * old) % new, which
    # cannot be shared evenly (as the loader's)
    kept = len(whole) - (len(whole) - 2 * old) % new
    assert sorted(taken + rest) == sorted(whole[:kept])


def test_new_weights_on_resume_go_on_from_the_next_batch_and_repeat_nothing(sources: dict[str, Path]) -> None:
    options: dict[str, Any] = {"batch_size": 10, "seed": 4, "epoch_size": 200}  # the epoch kept: 20 batches
    first = batchctl.mix(opened(sources), {"big": 0.9, "small": 0.1}, **options)
    given = [rows(b) for _, b in zip(range(6), first, strict=False)]
    resumed = batchctl.mix(opened(sources), {"big": 0.5, "small": 0.5}, **options)
    resumed.load_state_dict(first.state_dict())
    rest = [rows(b) for b in resumed]
    assert len(given) + len(rest) == 20
    assert all(Counter(v >= 1000 for v in b) == {False: 5, True: 5} for b in rest)
    big = [v for b in given + rest for v in b if v < 1000]
    assert len(big) == len(set(big))  # the big source: no row given twice this epoch
    small = [v for b in given + rest for v in b if v >= 1000]
    assert sorted(small[:60]) == list(range(1000, 1060))  # the small one's pass went on, not over


def test_a_rebuilt_source_or_unlike_fields_are_refused_in_one_line(sources: dict[str, Path], tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    make_numbered(copy, 1000, 60, 5)
    rebuilt = tmp_path / "small.zarr"
    args = ("--preprocess", "npy", "--batch-size", "4", "--compression", "none")
    assert run_cli("build", copy, "-o", rebuilt, *args).returncode == 0
    loader = batchctl.mix(opened(sources), {"big": 1, "small": 1}, batch_size=10)
    next(iter(loader))
    state = loader.state_dict()
    np.save(copy / "c0" / "s09999.npy", np.full(1024, 9999, dtype=np.int32))  # the folder grows
    assert run_cli("build", copy, "-o", rebuilt, *args).returncode == 0
    other = batchctl.mix(
        {"big": batchctl.open(sources["big"]), "small": batchctl.open(rebuilt)}, {"big": 1, "small": 1}, batch_size=10
    )
    with pytest.raises(batchctl.ResumeMismatchError, match="source 'small' is another version") as refused:
        other.load_state_dict(state)
    assert "\n" not in str(refused.value)
    wide = _build(tmp_path, "wide", 5000, 16, width=8)
    with pytest.raises(
        batchctl.UsageError, match=r"field 'array' is \(1024,\) int32 in 'big' but \(8,\) int32 in 'wide'"
    ):
        batchctl.mix({"big": sources["big"], "wide": wide}, {"big": 1, "wide": 1}, batch_size=10)
    labels = batchctl.mix({"big": sources["big"], "wide": wide}, {"big": 1, "wide": 1}, batch_size=10, fields=["label"])
    batch = next(iter(labels))
    assert set(batch) == {"label", "dataset"} and len(batch["label"]) == 10
    with pytest.raises(batchctl.UsageError, match="gets no row of a batch of 10"):
        batchctl.mix(opened(sources), {"big": 0.99, "small": 0.01}, batch_size=10)
    with pytest.raises(batchctl.UsageError, match="'small' has 60 rows, fewer than the 64 partitions"):
        batchctl.mix(opened(sources), {"big": 1, "small": 1}, batch_size=10, partitions=64)


def test_iterable_batches_reads_a_mixture_through_dataloader_workers_and_resumes(sources: dict[str, Path]) -> None:
    pytest.importorskip("torchdata")
    from torchdata.stateful_dataloader import StatefulDataLoader

    from batchctl.torch import IterableBatches

    weights = {"big": 0.7, "small": 0.3}
    # one partition per DataLoader worker: the mixture's order with partitions=2
    want = [
        b for epoch in epochs(batchctl.mix(opened(sources), weights, batch_size=10, partitions=2), 2) for b in epoch
    ]

    def run(stop: int | None = None, state: dict[str, Any] | None = None) -> tuple[list[list[int]], Any]:
        stream = IterableBatches(batchctl.mix(opened(sources), weights, batch_size=10))
        loader = StatefulDataLoader(stream, batch_size=None, num_workers=2)
        if state is not None:
            loader.load_state_dict(state)
        got: list[list[int]] = []
        for _ in range(2):
            for batch in loader:
                got.append(rows(batch))
                if len(got) == stop:
                    return got, loader.state_dict()
        return got, None

    assert run()[0] == want
    head, state = run(stop=9)
    tail, _ = run(state=state)
    assert head + tail[: len(want) - 9] == want  # resumed exactly: the rest of epoch 0, then epoch 1
