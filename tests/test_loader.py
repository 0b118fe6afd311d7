"""Training reads (`Dataset.loader`, `batchctl.torch.IterableBatches`) on datasets built by the real CLI.

Every sample is a one-row .npy whose value is its own number, written in its file name too, so a
batch's rows can be checked against their sources and followed one by one across ranks and resumes.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import random
import subprocess
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest

import batchctl
from batchctl.read.loader import Loader
from tests.conftest import ROOT, run_cli
from tests.ranks import bytes_read, run_ranks, stored_bytes

CLASSES, PER_CLASS, STORED = 5, 41, 8  # 205 samples: 25 full stored batches and a short one
WIDTH = 1024  # int32s per row: 4 KiB, so uncompressed rows are read straight into output batches


def make_numbered(root: Path, start: int, count: int, classes: int) -> None:
    for n in range(start, start + count):
        folder = root / f"c{n % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        np.save(folder / f"s{n:05d}.npy", np.full(WIDTH, n, dtype=np.int32))


def build_numbered(root: Path, compression: str) -> Path:
    """Class folders, built `--sorted`: each stored batch holds one class or two."""
    make_numbered(root / "src", 0, CLASSES * PER_CLASS, CLASSES)
    out = root / "numbered.zarr"
    args = ("--preprocess", "npy", "--batch-size", STORED, "--sorted", "--compression", compression)
    result = run_cli("build", root / "src", "-o", out, *args)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def numbered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_numbered(tmp_path_factory.mktemp("loader"), "none")


@pytest.fixture(scope="module")
def numbered_zstd(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_numbered(tmp_path_factory.mktemp("loader-zstd"), "zstd")


def ids(batch: dict[str, Any]) -> list[int]:
    """The samples of a batch, each checked against its own source path and label, every value
    of its row the same (a row never parts from its fields, nor is it torn)."""
    rows = np.asarray(batch["array"])
    assert (rows == rows[:, :1]).all()
    values = [int(v) for v in rows[:, 0]]
    sources = [int(str(s).rsplit("s", 1)[1].split(".")[0]) for s in batch["source"]]
    assert values == sources
    labels = np.asarray(batch["label"]).tolist()
    assert labels == [v % CLASSES for v in values]
    return values


def epoch_ids(loader: Loader | Any) -> list[list[int]]:
    return [ids(b) for b in loader]


def stored_batch_of(ds: Any) -> dict[int, int]:
    """Each sample's stored batch (a `--sorted` build stores them by class, not by number)."""
    return {n: index for index in range(len(ds)) for n in ids(ds[index])}


OPTION_SETS = [
    {},
    {"batch_size": 5},
    {"batch_size": 13, "mix": 4, "drop_last": False},
    {"batch_size": 20, "mix": 1},
    {"batch_size": 3, "shuffle": False, "drop_last": False},
    {"batch_size": 64, "mix": 2, "seed": 7},
]


@pytest.mark.parametrize("options", OPTION_SETS)
@pytest.mark.parametrize("stored", ["numbered", "numbered_zstd"])
def test_every_sample_once_in_batches_of_any_size(
    request: pytest.FixtureRequest, stored: str, options: dict[str, Any]
) -> None:
    ds = batchctl.open(request.getfixturevalue(stored))
    loader = ds.loader(**options)
    size = options.get("batch_size", STORED)
    epoch = epoch_ids(loader)
    flat = [n for batch in epoch for n in batch]
    assert len(flat) == len(set(flat))
    if options.get("drop_last", True):
        assert [len(b) for b in epoch] == [size] * (ds.num_samples // size)
        assert len(flat) > ds.num_samples - size
    else:
        assert sorted(flat) == list(range(ds.num_samples))
        assert all(len(b) == size for b in epoch[:-1])
    if not options.get("shuffle", True):
        assert flat == [n for i in range(len(ds)) for n in ids(ds[i])]  # stored order
    again = epoch_ids(loader)  # the next epoch
    assert (again != epoch) == options.get("shuffle", True)
    assert epoch_ids(ds.loader(**options)) == epoch  # a pure function of the options and the epoch


def test_ranks_share_one_order(numbered: Path) -> None:
    """Every world size dividing the partitions gets world size 1's order, each rank reading its
    own stored batches (a cut between two shares may split one between them)."""
    ds = batchctl.open(numbered)
    options = {"batch_size": 6, "mix": 4, "seed": 3, "partitions": 12}
    whole = ds.loader(**options)
    whole.set_epoch(2)
    single = epoch_ids(whole)
    for world in (2, 3, 4, 6):
        shares = []
        for rank in range(world):
            loader = ds.loader(**options, rank=rank, world_size=world)
            loader.set_epoch(2)
            assert len(loader) == len(single) // world
            shares.append(epoch_ids(loader))
        assert {len(s) for s in shares} == {len(single) // world}  # equal steps, as DDP needs
        # global batch j goes to rank j % world: the ranks' shares interleave back into the one order
        assert [shares[j % world][j // world] for j in range(len(shares[0]) * world)] == single[
            : len(shares[0]) * world
        ]
        where = stored_batch_of(ds)
        stored = [{where[n] for b in share for n in b} for share in shares]
        # no stored batch read by two ranks, but those a cut between two of the 12 shares splits
        assert sum(map(len, stored)) - len(set().union(*stored)) <= 12 - 1
    padded = [epoch_ids(ds.loader(batch_size=25, drop_last=False, rank=r, world_size=3)) for r in range(3)]
    assert [len(p) for p in padded] == [3, 3, 3]  # 9 batches of <= 25 rows; the last round filled from the first
    assert sorted(n for p in padded for b in p for n in b)[: ds.num_samples] == list(range(ds.num_samples))


def _resume_in_new_process(path: Path, options: dict[str, Any], state: dict[str, Any], epochs: int) -> list[list[int]]:
    code = (
        "import json, sys, batchctl\n"
        "path, options, state, epochs = json.loads(sys.argv[1])\n"
        "loader = batchctl.open(path).loader(**options)\n"
        "loader.load_state_dict(state)\n"
        "out = [[int(v) for v in b['array'][:, 0]] for _ in range(epochs) for b in loader]\n"
        "print(json.dumps(out))\n"
    )
    arg = json.dumps([str(path), options, state, epochs])
    done = subprocess.run([sys.executable, "-c", code, arg], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    return [list(b) for b in json.loads(done.stdout)]


@pytest.mark.parametrize("options", OPTION_SETS[:4])
def test_exact_resume_at_random_steps(numbered: Path, options: dict[str, Any]) -> None:
    ds = batchctl.open(numbered)
    reference = ds.loader(**options)
    expected = epoch_ids(reference) + epoch_ids(reference)  # two uninterrupted epochs
    rng = random.Random(repr(options))
    for k in sorted({rng.randrange(1, len(expected)) for _ in range(3)} | {len(expected) // 2}):
        first = ds.loader(**options)
        got: list[list[int]] = []
        for _ in range(2):
            for batch in first:
                got.append(ids(batch))
                if len(got) == k:
                    break
            if len(got) == k:
                break
        state = json.loads(json.dumps(first.state_dict()))  # plain JSON
        epochs_left = 2 - state["epoch"]  # after an epoch's last batch, the state is the next one's start
        rest = _resume_in_new_process(numbered, options, state, epochs_left) if k == len(expected) // 2 else None
        if rest is None:
            second = ds.loader(**options)
            second.load_state_dict(state)
            rest = [ids(b) for _ in range(epochs_left) for b in second]
        assert got + rest == expected, (options, k)


def test_resume_twice_in_a_row(numbered: Path) -> None:
    ds = batchctl.open(numbered)
    options = {"batch_size": 7, "mix": 4}
    expected = epoch_ids(ds.loader(**options))
    got: list[list[int]] = []
    state = None
    for stop in (5, 11, len(expected)):
        loader = ds.loader(**options)
        if state is not None:
            loader.load_state_dict(state)
        for batch in loader:
            got.append(ids(batch))
            if len(got) == stop:
                break
        state = loader.state_dict()
    assert got == expected
    loader = ds.loader(**options)
    loader.load_state_dict(state)  # saved after the epoch's last batch: what follows is the next epoch
    reference = ds.loader(**options)
    reference.set_epoch(1)
    assert epoch_ids(loader) == epoch_ids(reference)


@pytest.mark.parametrize(("old", "new"), [(4, 2), (2, 3), (3, 1)])
def test_elastic_resume_on_another_world_size(numbered: Path, old: int, new: int) -> None:
    ds = batchctl.open(numbered)
    options = {"batch_size": 4, "mix": 8, "seed": 11, "partitions": 12}
    epoch = epoch_ids(ds.loader(**options))
    total = len(epoch)
    consumed: list[int] = []
    states = []
    for rank in range(old):  # each old rank takes k steps, as under DDP
        loader = ds.loader(**options, rank=rank, world_size=old)
        for step, batch in enumerate(loader, 1):
            consumed.extend(ids(batch))
            if step == 5:
                break
        states.append(loader.state_dict())
    assert all(s == states[0] for s in states)  # every rank saves the same state: keep rank 0's
    state = json.loads(json.dumps(states[0]))
    remaining: list[int] = []
    lengths = set()
    for rank in range(new):
        loader = ds.loader(**options, rank=rank, world_size=new)
        loader.load_state_dict(state)
        share = epoch_ids(loader)
        lengths.add(len(share))
        remaining.extend(n for b in share for n in b)
    assert len(lengths) == 1  # equal steps on the new ranks too
    assert not set(consumed) & set(remaining) and len(remaining) == len(set(remaining))
    # over the new ranks together: every sample the old ranks had not consumed, sample by sample,
    # but for the last (total - 5 * old) % new batches, which cannot be shared evenly (drop_last)
    left_over = (total - 5 * old) % new
    expected = {n for b in epoch[5 * old : total - left_over] for n in b}
    assert set(remaining) == expected
    assert set(consumed) == {n for b in epoch[: 5 * old] for n in b}


def test_a_resume_outside_the_partitions_family_is_refused_in_one_line(numbered: Path) -> None:
    ds = batchctl.open(numbered)
    states = []
    for rank in range(2):  # partitions not given: one per rank, fixed by this run
        loader = ds.loader(batch_size=4, rank=rank, world_size=2)
        next(iter(loader))
        states.append(loader.state_dict())
    assert states[0]["options"]["partitions"] == 2
    single = ds.loader(batch_size=4)  # 1 divides 2: resumed exactly, the state's partitions taken
    single.load_state_dict(json.loads(json.dumps(states[0])))
    assert single.options.partitions == 2
    assert epoch_ids(single) == epoch_ids(ds.loader(batch_size=4, partitions=2))[2:]
    with pytest.raises(batchctl.ResumeMismatchError, match=r"cut into 2 partitions, which 3 ranks") as caught:
        ds.loader(batch_size=4, rank=0, world_size=3).load_state_dict(states[0])
    assert "\n" not in str(caught.value) and "partitions= a multiple" in str(caught.value)
    with pytest.raises(batchctl.UsageError, match=r"cut into 4 partitions, which 3 ranks"):
        ds.loader(rank=0, world_size=3, partitions=4)
    with pytest.raises(batchctl.ResumeMismatchError, match=r"saved with partitions=2, this loader has partitions=4"):
        ds.loader(batch_size=4, partitions=4).load_state_dict(states[0])


def test_a_state_of_another_version_or_options_is_refused(tmp_path: Path) -> None:
    make_numbered(tmp_path / "src", 0, 40, 2)
    out = tmp_path / "d.zarr"
    assert run_cli("build", tmp_path / "src", "-o", out, "--preprocess", "npy", "--batch-size", 8).returncode == 0
    loader = batchctl.open(out).loader(batch_size=5)
    next(iter(loader))
    state = loader.state_dict()
    with pytest.raises(batchctl.ResumeMismatchError, match=r"saved with batch_size=5, this loader has batch_size=6"):
        batchctl.open(out).loader(batch_size=6).load_state_dict(state)
    with pytest.raises(batchctl.ResumeMismatchError, match=r"saved with mix=16, this loader has mix=4"):
        batchctl.open(out).loader(batch_size=5, mix=4).load_state_dict(state)
    make_numbered(tmp_path / "src", 40, 3, 2)  # the folder grows; the nightly build adds them
    assert run_cli("build", tmp_path / "src", "-o", out, "--preprocess", "npy", "--batch-size", 8).returncode == 0
    with pytest.raises(batchctl.ResumeMismatchError, match="another version of the dataset") as caught:
        batchctl.open(out).loader(batch_size=5).load_state_dict(state)
    assert "\n" not in str(caught.value)
    with pytest.raises(batchctl.ResumeMismatchError, match="not a batchctl loader state"):
        loader.load_state_dict({"epoch": 1})
    with pytest.raises(batchctl.UsageError, match="batch_size to be an int >= 1"):
        batchctl.open(out).loader(batch_size=0)
    numpy_ints = batchctl.open(out).loader(batch_size=np.int64(5), seed=np.int64(3))
    json.dumps(numpy_ints.state_dict())  # options given as NumPy ints still make a JSON state


def test_mixing_raises_classes_per_batch(numbered: Path) -> None:
    """The shuffle-quality figures' direction on a class-sorted build (benchmarks report the figures)."""
    ds = batchctl.open(numbered)

    def distinct(mix: int) -> float:
        counts = [len(Counter(np.asarray(b["label"]).tolist())) for b in ds.loader(mix=mix, seed=1)]
        return sum(counts) / len(counts)

    d1, d4, d16 = distinct(1), distinct(4), distinct(16)
    assert d1 < 2.1 < d4 < d16  # sorted stored batches of 8 hold one or two classes; mixing spreads them
    assert d16 > 0.9 * CLASSES * (1 - (1 - 1 / CLASSES) ** STORED)  # near a global permutation's expectation


def test_iter_batches_is_the_whole_stored_batches(numbered: Path) -> None:
    ds = batchctl.open(numbered)
    plain = [ids(b) for b in ds.iter_batches()]
    assert plain == [ids(ds[i]) for i in range(len(ds))]
    shuffled = [ids(b) for b in ds.iter_batches(shuffle=True, seed=1, epoch=2)]
    assert sorted(map(tuple, shuffled)) == sorted(map(tuple, plain)) and shuffled != plain
    ranks = [[ids(b) for b in ds.iter_batches(shuffle=True, seed=1, rank=r, world_size=4)] for r in range(4)]
    assert {len(r) for r in ranks} == {6}  # 25 full batches among 4 ranks, the short one left out
    assert len({tuple(b) for r in ranks for b in r}) == 24


def test_a_damaged_chunk_read_by_the_loader_is_a_format_error(tmp_path: Path) -> None:
    """Rows read straight into output batches are still checked: one flipped byte is caught."""
    make_numbered(tmp_path / "src", 0, 64, CLASSES)
    out = tmp_path / "d.zarr"
    args = ("--preprocess", "npy", "--batch-size", 8, "--compression", "none")
    result = run_cli("build", tmp_path / "src", "-o", out, *args)
    assert result.returncode == 0, result.stderr
    ds = batchctl.open(out)
    assert epoch_ids(ds.loader(mix=4))  # whole, it reads
    shard = next(p for p in (out / "array" / "c").rglob("*") if p.is_file())
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF  # a row of stored batch 0
    shard.write_bytes(bytes(data))
    with pytest.raises(batchctl.FormatError, match="checksum does not match"):
        list(batchctl.open(out).loader(mix=4))
    # 4 ranks, each reading its own stored batches: the one whose share holds batch 0 says so
    said = {}
    for rank in range(4):
        loader = batchctl.open(out).loader(mix=4, batch_size=4, rank=rank, world_size=4)
        try:
            epoch_ids(loader)
        except batchctl.FormatError as exc:
            said[rank] = str(exc)
    readers = [rank for rank in range(4) if 0 in loader.order(0).stored_read_by(rank, 4)]
    assert list(said) == readers and len(readers) == 1
    assert said[readers[0]] == "array shard 0, batch 0: the chunk checksum does not match", said


def test_ranks_and_dataloader_workers_read_each_stored_byte_once(numbered: Path) -> None:
    """4 ranks (processes with torchrun's environment) x 2 DataLoader workers: the bytes their
    processes read, as the kernel counts them, are the stored bytes once, plus a shard index per
    consumer and the stored batches a cut between two shares splits (at most one a cut); together
    they take the one order of 8 partitions, every row once."""
    pytest.importorskip("torch")
    options = {"batch_size": 6, "mix": 4, "seed": 1}
    grid = json.loads((numbered / "array" / "zarr.json").read_text())["chunk_grid"]["configuration"]
    index = 4 * ((grid["chunk_shape"][0] // STORED) * 16 + 4)  # a shard index of each of the 4 arrays
    stored = stored_bytes(numbered, ["array"])  # labels and sources are compressed: read from a mapping, uncounted
    for world, workers in ((4, 2), (1, 2)):
        consumers = world * workers
        ranks = run_ranks(numbered, world, workers, options)
        read = sum(rank["read"] for rank in ranks)
        one = stored / len(batchctl.open(numbered))  # a stored batch's bytes
        assert read <= 1.01 * stored + (consumers - 1) * one + consumers * index, (world, workers, read / stored)
        order = batchctl.open(numbered).loader(**options, partitions=consumers).order(0)
        taken = order.batches - order.batches % world  # (drop_last: the last round the ranks cannot share)
        want = [str(s) for j in range(taken) for s in _sources_of(numbered, order.rows(j))]
        got = [s for rank in ranks for s in rank["sources"]]
        assert sorted(got) == sorted(want) and len(set(got)) == len(got)  # every row of the order once


def _sources_of(path: Path, rows: np.ndarray) -> list[str]:
    ds = batchctl.open(path)
    return [str(ds.sample(int(row))["source"]) for row in rows]


# --- PyTorch ---------------------------------------------------------------------------------


def _stateful_run(
    path: Path, workers: int, stop: int | None = None, state: dict[str, Any] | None = None, epochs: int = 2
) -> tuple[list[list[int]], dict[str, Any] | None]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    from batchctl.torch import IterableBatches

    stream = IterableBatches(path, batch_size=6, mix=4, seed=5)
    loader = StatefulDataLoader(stream, batch_size=None, num_workers=workers)
    if state is not None:
        loader.load_state_dict(state)
    got: list[list[int]] = []
    for _ in range(epochs):
        for batch in loader:
            got.append(ids(batch))
            if len(got) == stop:
                return got, loader.state_dict()
    return got, None


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_dataloader_workers_started_by_spawn_or_forkserver_read_what_forked_ones_read(
    numbered: Path, context: str
) -> None:
    """macOS starts DataLoader workers by spawn (and a user may ask for forkserver): the stream
    goes to them pickled, its shared epoch, locks and batch ring with it, and two epochs read the
    same batches, each row once, as with forked workers (a lock of the fork context refused to go)."""
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from batchctl.torch import IterableBatches

    def two_epochs(start: str) -> list[list[list[int]]]:
        stream = IterableBatches(numbered, batch_size=6, mix=4, seed=5)
        loader = DataLoader(stream, batch_size=None, num_workers=2, multiprocessing_context=start)
        return [[ids(batch) for batch in loader] for _ in range(2)]

    got, forked = two_epochs(context), two_epochs("fork")
    assert got == forked and got[0] != got[1]
    for epoch in got:
        rows = [row for batch in epoch for row in batch]
        assert len(rows) == len(set(rows)) > 0


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader_resumes_exactly(numbered: Path, workers: int) -> None:
    pytest.importorskip("torchdata")
    reference = batchctl.open(numbered).loader(batch_size=6, mix=4, seed=5, partitions=max(workers, 1))
    expected = epoch_ids(reference) + epoch_ids(reference)
    full, _ = _stateful_run(numbered, workers)
    assert full == expected  # the loader's order with or without workers, epochs advancing by themselves
    for stop in (7, len(expected) // 2, len(expected) // 2 + 3):
        head, state = _stateful_run(numbered, workers, stop=stop)
        assert state is not None
        tail, _ = _stateful_run(numbered, workers, state=state, epochs=1 if stop >= len(expected) // 2 else 2)
        assert head + tail == expected, (workers, stop)


def test_torch_epochs_advance_with_persistent_workers(numbered: Path) -> None:
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from batchctl.torch import IterableBatches

    reference = batchctl.open(numbered).loader(batch_size=10, seed=2, partitions=2)  # one per worker
    epochs = [epoch_ids(reference) for _ in range(3)]
    stream = IterableBatches(numbered, batch_size=10, seed=2)
    loader = DataLoader(stream, batch_size=None, num_workers=2, persistent_workers=True)
    got = []
    for epoch in range(2):
        stream.set_epoch(epoch)  # as a new user writes it
        got.append([ids(b) for b in loader])
    assert got == epochs[:2] and got[0] != got[1]
    stream.set_epoch(0)  # reaches the kept workers too
    assert [ids(b) for b in loader] == epochs[0]
    plain = DataLoader(stream, batch_size=None, num_workers=2)  # workers made again each epoch
    stream.set_epoch(1)
    assert [ids(b) for b in plain] == epochs[1] and [ids(b) for b in plain] == epochs[2]
    ranks = [
        [
            ids(b)
            for b in DataLoader(
                IterableBatches(numbered, batch_size=10, seed=2, rank=r, world_size=2), batch_size=None, num_workers=2
            )
        ]
        for r in range(2)
    ]
    order = epoch_ids(batchctl.open(numbered).loader(batch_size=10, seed=2, partitions=4))  # 2 ranks x 2 workers
    assert [ranks[j % 2][j // 2] for j in range(2 * len(ranks[0]))] == order


def _late_start(worker: int) -> None:
    time.sleep(0.4 * worker)  # worker 0 hands out its whole share before the last one begins


@pytest.mark.parametrize("persistent", [False, True])
def test_a_dataloader_worker_that_begins_late_still_takes_its_share_of_the_epoch(
    numbered: Path, persistent: bool
) -> None:
    """Workers begin when they are scheduled: one that finished its share (and moved the shared
    epoch on) before a sibling began must not send that sibling into the next epoch."""
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from batchctl.torch import IterableBatches

    reference = batchctl.open(numbered).loader(batch_size=40, mix=1, seed=4, partitions=4)  # a step per worker
    epochs = [sorted(n for b in epoch_ids(reference) for n in b) for _ in range(2)]
    stream = IterableBatches(numbered, batch_size=40, mix=1, seed=4)
    loader = DataLoader(
        stream, batch_size=None, num_workers=4, worker_init_fn=_late_start, persistent_workers=persistent
    )
    for epoch in range(2):
        got = [ids(b) for b in loader]
        assert sorted(n for b in got for n in b) == epochs[epoch]
        assert stream.epoch == epoch + 1


DDP_RANK = """
import json, os, sys
import torch.distributed as dist
from torch.utils.data import DataLoader
from batchctl.torch import IterableBatches

dist.init_process_group("gloo")  # rank, world size, address from the environment, as torchrun sets them
stream = IterableBatches(sys.argv[1], batch_size=10, seed=2)
got = [[int(v) for v in b["array"][:, 0]] for b in DataLoader(stream, batch_size=None, num_workers=2)]
print(json.dumps({"rank": stream.rank, "world": stream.world_size, "steps": len(stream), "batches": got}))
dist.destroy_process_group()
"""


def test_ranks_come_from_torch_distributed(numbered: Path) -> None:
    """Two processes joined by torch.distributed (gloo, as torchrun starts them): each takes its
    rank's share, split between its DataLoader workers, and together they make the one order."""
    pytest.importorskip("torch")
    from tests.conftest import free_port

    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", DDP_RANK, str(numbered)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(r), "WORLD_SIZE": "2"},
        )
        for r in range(2)
    ]
    shares = {}
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        share = json.loads(out.strip().splitlines()[-1])
        assert share["world"] == 2 and share["steps"] == len(share["batches"])
        shares[share["rank"]] = share["batches"]
    order = epoch_ids(batchctl.open(numbered).loader(batch_size=10, seed=2, partitions=4))  # 2 ranks x 2 workers
    assert len(shares[0]) == len(shares[1]) == len(order) // 2
    assert [shares[j % 2][j // 2] for j in range(len(order))] == order


# --- resume states checked ----------------------------------------------------------------------


@pytest.mark.parametrize("position", [34, 10**12, 2**70])
def test_a_resume_position_past_the_epoch_is_refused_in_one_line(numbered: Path, position: int) -> None:
    loader = batchctl.open(numbered).loader(batch_size=6)  # 205 samples: 34 batches of 6
    state = {**loader.state_dict(), "position": position}
    with pytest.raises(batchctl.ResumeMismatchError) as refused:
        batchctl.open(numbered).loader(batch_size=6).load_state_dict(state)
    assert "\n" not in str(refused.value) and ("past the end of epoch" in str(refused.value) or position >= 2**63)
    state = {**loader.state_dict(), "position": 33}
    batchctl.open(numbered).loader(batch_size=6).load_state_dict(state)  # the epoch's last batch: fine
    with pytest.raises(batchctl.ResumeMismatchError):
        batchctl.open(numbered).loader(batch_size=6).load_state_dict({**state, "epoch": 2**70})


def _stream_state(path: Path, workers: int, rank: int, world: int, stop: int) -> tuple[list[list[int]], dict]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    from batchctl.torch import IterableBatches

    stream = IterableBatches(path, batch_size=6, mix=4, seed=5, rank=rank, world_size=world)
    loader = StatefulDataLoader(stream, batch_size=None, num_workers=workers)
    got = []
    for batch in loader:
        got.append(ids(batch))
        if len(got) == stop:
            break
    return got, loader.state_dict()


def test_an_iterable_batches_state_resumes_exactly_on_another_world_size_or_is_refused(numbered: Path) -> None:
    pytest.importorskip("torchdata")
    from torchdata.stateful_dataloader import StatefulDataLoader

    from batchctl.torch import IterableBatches

    expected = epoch_ids(batchctl.open(numbered).loader(batch_size=6, mix=4, seed=5, partitions=2))  # one per rank
    heads = [_stream_state(numbered, 0, rank, 2, stop=5) for rank in range(2)]
    assert heads[0][0] == expected[0:10:2] and heads[1][0] == expected[1:10:2]
    for state in (heads[0][1], heads[1][1]):  # either rank's state: the same global position
        stream = IterableBatches(numbered, batch_size=6, mix=4, seed=5, rank=0, world_size=1)
        loader = StatefulDataLoader(stream, batch_size=None, num_workers=0)
        loader.load_state_dict(state)
        assert [ids(b) for b in loader] == expected[10:]  # nothing twice, nothing left out
    _, with_workers = _stream_state(numbered, 2, 0, 2, stop=5)
    stream = IterableBatches(numbered, batch_size=6, mix=4, seed=5, rank=0, world_size=1)
    loader = StatefulDataLoader(stream, batch_size=None, num_workers=2)
    loader.load_state_dict(with_workers)
    with pytest.raises(batchctl.ResumeMismatchError, match="resumes only on 2 ranks") as refused:
        next(iter(loader))
    assert "\n" not in str(refused.value) and "DataLoader worker process" in str(refused.value)
    let_go_of_workers(refused.value)
    del loader, refused  # its workers end with it
    gc.collect()


@pytest.mark.parametrize(("saved", "resumed"), [(2, 0), (0, 2), (2, 1), (2, 3)])
def test_a_state_of_other_dataloader_workers_resumes_exactly(numbered: Path, saved: int, resumed: int) -> None:
    """torchdata's own StatefulDataLoader fails on an assertion there; the stream's takes up the
    rank's place: the rest of the epoch, every batch once, in the loader's order."""
    pytest.importorskip("torchdata")
    from batchctl.torch import IterableBatches

    partitions = 6  # (a family that 1, 2 and 3 consumers divide)
    expected = epoch_ids(batchctl.open(numbered).loader(batch_size=6, mix=4, seed=5, partitions=partitions))
    for stop in (1, 4, len(expected) - 1):
        loader = IterableBatches(numbered, batch_size=6, mix=4, seed=5, partitions=partitions).dataloader(
            num_workers=saved
        )
        head = [ids(batch) for batch in itertools.islice(loader, stop)]
        state = loader.state_dict()
        del loader
        other = IterableBatches(numbered, batch_size=6, mix=4, seed=5).dataloader(num_workers=resumed)
        other.load_state_dict(state)
        assert head + [ids(batch) for batch in other] == expected, (saved, resumed, stop)
        del other
    gc.collect()


def test_elastic_resume_with_dataloader_workers(numbered: Path) -> None:
    """4 ranks x 2 DataLoader workers stopped after 3 steps, resumed from rank 0's state on 2
    ranks x 2 workers (torchrun's usual elastic change) and on 3 ranks x 1: together the new
    ranks take every row the old ones had not, once."""
    pytest.importorskip("torchdata")
    from batchctl.torch import IterableBatches

    options = {"batch_size": 4, "mix": 4, "seed": 3, "partitions": 24}
    total = {n for b in epoch_ids(batchctl.open(numbered).loader(**options)) for n in b}
    consumed: list[int] = []
    states = []
    for rank in range(4):
        loader = IterableBatches(numbered, **options, rank=rank, world_size=4).dataloader(num_workers=2)
        consumed += [n for batch in itertools.islice(loader, 3) for n in ids(batch)]
        states.append(json.loads(json.dumps(loader.state_dict())))  # (as a checkpoint file holds it)
        del loader
    for world, workers in ((2, 2), (3, 1)):
        remaining: list[int] = []
        lengths = set()
        for rank in range(world):
            loader = IterableBatches(numbered, **options, rank=rank, world_size=world).dataloader(num_workers=workers)
            loader.load_state_dict(states[0])
            share = [ids(batch) for batch in loader]
            lengths.add(len(share))
            remaining += [n for batch in share for n in batch]
            del loader
        assert len(lengths) == 1  # equal steps on the new ranks
        assert not set(consumed) & set(remaining) and len(remaining) == len(set(remaining))
        left_out = total - set(consumed) - set(remaining)
        assert len(left_out) < world * options["batch_size"], (world, workers)  # drop_last: under one round
    gc.collect()


def let_go_of_workers(error: BaseException) -> None:
    """Break the reference cycle a DataLoader worker's error re-raised in the main process is
    in (torch raises it from a frame its traceback holds), so the DataLoader goes when it is let
    go of: left to the garbage collector, multiprocessing's finalizers close its index queues
    before its own stop for the workers is sent, and it waits 5 s for each (measured: 10 s
    against 0.15 s with 2 workers)."""
    traceback.clear_frames(error.__traceback__)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_dataloader_state_past_the_epoch_is_refused_in_one_line(numbered: Path, workers: int) -> None:
    pytest.importorskip("torchdata")
    _, state = _stateful_run(numbered, workers, stop=3)
    assert state is not None
    for key, value in (("yielded", 1000), ("position", 10**12)):
        tampered = _replace_in(state, key, value)
        message = ""
        try:
            _stateful_run(numbered, workers, state=tampered, epochs=1)
        except batchctl.ResumeMismatchError as exc:
            message = str(exc)  # (not kept: its traceback holds the DataLoader, whose workers end with it)
            let_go_of_workers(exc)
        gc.collect()
        assert message and "\n" not in message, message


def _replace_in(value: Any, key: str, new: int) -> Any:
    """`value` with every `key` of every mapping inside it set to `new`."""
    if isinstance(value, dict):
        return {k: new if k == key else _replace_in(v, key, new) for k, v in value.items()}
    if isinstance(value, list):
        return [_replace_in(v, key, new) for v in value]
    return value


_RECIPE = """
import sys
from torchdata.stateful_dataloader import StatefulDataLoader
from batchctl.torch import IterableBatches
loader = StatefulDataLoader(IterableBatches(sys.argv[1], batch_size=6), batch_size=None, num_workers=0)
print(sum(1 for _ in loader))
"""


def test_the_pytorch_recipe_runs_without_warnings_and_the_extra_is_a_range(numbered: Path) -> None:
    pytest.importorskip("torchdata")
    import tomllib

    from packaging.requirements import Requirement

    result = subprocess.run(
        [sys.executable, "-W", "default", "-c", _RECIPE, str(numbered)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "34", result.stderr
    assert "Warning" not in result.stderr, result.stderr  # torchdata's 'set_vital' deprecation is not the user's
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["torch"]
    (torch,) = (Requirement(r) for r in extra)
    import torch as installed

    for version in (installed.__version__, "2.4.1+cu121", "2.7.0"):  # the suite's, and a user's CUDA builds
        assert torch.specifier.contains(version, prereleases=False), (version, torch.specifier)


def test_set_epoch_of_another_epoch_after_a_resume_says_so_in_one_line(
    numbered: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = batchctl.open(numbered).loader(batch_size=6, mix=4)
    first.set_epoch(1)
    taken = [ids(b) for _, b in zip(range(3), first, strict=False)]
    state = first.state_dict()
    right = batchctl.open(numbered).loader(batch_size=6, mix=4)
    right.load_state_dict(state)
    start_epoch = right.epoch  # the recipe: the state knows its epoch
    with caplog.at_level("WARNING", logger="batchctl"):
        right.set_epoch(start_epoch)
        rest = epoch_ids(right)
    whole = batchctl.open(numbered).loader(batch_size=6, mix=4)
    whole.set_epoch(1)
    assert taken + rest == epoch_ids(whole)  # resumed exactly where the state stopped
    assert [r for r in caplog.records if r.name == "batchctl"] == []
    wrong = batchctl.open(numbered).loader(batch_size=6, mix=4)
    wrong.load_state_dict(state)
    with caplog.at_level("WARNING", logger="batchctl"):
        wrong.set_epoch(0)  # a guessed start_epoch: the loaded position is discarded, and it says so
    said = [r.getMessage() for r in caplog.records if r.name == "batchctl"]
    assert len(said) == 1 and "set_epoch(0) discards the state just loaded (epoch 1, position 3)" in said[0]
    assert "\n" not in said[0]


def test_too_many_ranks_or_too_big_a_batch_for_an_epoch_is_one_line_not_an_empty_epoch(numbered: Path) -> None:
    ds = batchctl.open(numbered)  # 205 samples
    # 22 batches of 9 for 23 ranks: some rank would have none (23 with the short one)
    for options in ({"batch_size": 9, "world_size": 23, "rank": 3}, {"batch_size": 4000}):
        with pytest.raises(batchctl.UsageError) as refused:
            ds.loader(**options)  # type: ignore[arg-type]
        assert "\n" not in str(refused.value) and "drop_last=False" in str(refused.value)
    wide = ds.loader(batch_size=6, world_size=64, rank=3, drop_last=False)  # 35 batches, 29 of them twice
    assert len(wide) == 1 and wide.padding == 29 * 6
    # the documented padding: every rank takes as many steps, the last round from the epoch's first batches
    padded = [epoch_ids(ds.loader(batch_size=9, world_size=20, rank=r, drop_last=False)) for r in range(20)]
    assert {len(share) for share in padded} == {2}  # 23 batches: 17 of them taken twice
    assert ds.loader(batch_size=9, world_size=20, rank=0, drop_last=False).padding == 17 * 9
    assert {n for share in padded for batch in share for n in batch} == set(range(ds.num_samples))


@pytest.mark.parametrize("mix", [1, 4])
def test_fields_reads_only_those_arrays_in_the_same_order(numbered: Path, mix: int) -> None:
    ds = batchctl.open(numbered)
    before = bytes_read()
    full = list(ds.loader(batch_size=6, mix=mix, seed=2))
    everything = bytes_read() - before
    opened = batchctl.open(numbered)  # (its documents read here, not counted)
    before = bytes_read()
    labels = list(opened.loader(batch_size=6, mix=mix, seed=2, fields=["label"]))
    only_labels = bytes_read() - before
    assert [sorted(b) for b in labels] == [["label"]] * len(full)
    assert [b["label"].tolist() for b in labels] == [b["label"].tolist() for b in full]  # the same order
    assert only_labels < 0.02 * everything, (only_labels, everything)  # rows of 4 KiB not read
    with pytest.raises(batchctl.UsageError, match="fields"):
        ds.loader(fields=["labels"])
    pytest.importorskip("torch")
    from batchctl.torch import BatchDataset, IterableBatches

    stream = IterableBatches(numbered, batch_size=6, mix=mix, seed=2, fields=["label", "source"])
    got = list(stream)
    assert [sorted(b) for b in got] == [["label", "source"]] * len(full)
    assert [b["source"] for b in got] == [[str(s) for s in b["source"]] for b in full]
    assert sorted(BatchDataset(numbered, fields=["array"])[0]) == ["array"]


# --- subsets and splits ---------------------------------------------------------------------------


def test_a_subset_gives_its_rows_once_an_epoch_reads_only_its_batches_and_resumes(numbered: Path) -> None:
    ds = batchctl.open(numbered)  # built --sorted: each class's rows lie together
    by_class = ds.subset(labels=["c1", 3])
    want = {n for n in range(CLASSES * PER_CLASS) if n % CLASSES in (1, 3)}
    for epoch in range(2):
        loader = by_class.loader(batch_size=6, mix=4, drop_last=False)
        loader.set_epoch(epoch)
        got = [n for b in loader for n in ids(b)]
        assert sorted(got) == sorted(want)  # each row once
    stored = [str(path) for b in ds for path in b["source"]]  # every row's file, in row order
    glob = ds.subset(source="c2/*", rows=np.arange(CLASSES * PER_CLASS) < 100)  # and among the first 100 rows
    want_glob = {int(path.rsplit("s", 1)[1].split(".")[0]) for path in stored[:100] if path.startswith("c2/")}
    assert want_glob and {n for b in glob.loader(batch_size=5, drop_last=False) for n in ids(b)} == want_glob
    before = bytes_read()
    list(ds.loader(batch_size=6, mix=4))
    everything = bytes_read() - before
    one = ds.subset(labels=["c1"])  # 41 rows of 205: 6 or 7 of the 26 stored batches
    before = bytes_read()
    list(one.loader(batch_size=6, mix=4))
    assert bytes_read() - before < 0.35 * everything
    loader = by_class.loader(batch_size=6, mix=4)
    head = [ids(b) for _, b in zip(range(4), loader, strict=False)]
    state = loader.state_dict()
    again = by_class.loader(batch_size=6, mix=4)
    again.load_state_dict(state)
    assert head + [ids(b) for b in again] == epoch_ids(by_class.loader(batch_size=6, mix=4))
    with pytest.raises(batchctl.ResumeMismatchError, match="another version"):
        one.loader(batch_size=6, mix=4).load_state_dict(state)  # another subset's state
    with pytest.raises(batchctl.UsageError, match="labels among"):
        ds.subset(labels=["dog"])


def test_splits_are_stable_when_the_folder_grows_shrinks_and_is_rebuilt(tmp_path: Path) -> None:
    src, out = tmp_path / "src", tmp_path / "d.zarr"
    make_numbered(src, 0, 300, 3)
    args = ("--preprocess", "npy", "--batch-size", STORED)
    assert run_cli("build", src, "-o", out, *args).returncode == 0

    def splits() -> dict[str, set[str]]:
        ds = batchctl.open(out)
        parts = ds.split({"train": 0.9, "val": 0.1}, seed=4)
        found = {name: {str(s) for b in part.loader(drop_last=False, fields=["source"]) for s in b["source"]}
                 for name, part in parts.items()}  # fmt: skip
        assert sum(len(v) for v in found.values()) == ds.num_samples and not found["train"] & found["val"]
        return found

    first = splits()
    assert 0.05 * 300 <= len(first["val"]) <= 0.15 * 300
    removed = sorted(src.rglob("*.npy"))[::20]  # 5% fewer
    for path in removed:
        path.unlink()
    make_numbered(src, 300, 30, 3)  # 10% more
    result = run_cli("build", src, "-o", out, *args)
    assert result.returncode == 0 and "30 added, 0 changed, 15 removed" in result.stderr, result.stderr  # incremental
    second = splits()
    for name in first:
        survivors = first[name] - {p.relative_to(src).as_posix() for p in removed}
        assert survivors <= second[name]  # every surviving file kept its split


def test_iterable_batches_reads_a_split_with_dataloader_workers(numbered: Path) -> None:
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from batchctl.torch import IterableBatches

    parts = batchctl.open(numbered).split({"train": 0.8, "val": 0.2}, seed=1)
    train, val = parts["train"], parts["val"]
    want = epoch_ids(train.loader(batch_size=6, mix=4, seed=5, partitions=2))  # one per DataLoader worker
    stream = IterableBatches(train, batch_size=6, mix=4, seed=5)
    got = [ids(b) for b in DataLoader(stream, batch_size=None, num_workers=2)]
    assert got == want  # the subset's loader order, through the workers
    held_out = {n for b in val.loader(batch_size=1, drop_last=False) for n in ids(b)}
    assert held_out and not held_out & {n for b in got for n in b}  # nothing of the other split
    assert len({n for b in got for n in b}) == sum(len(b) for b in got)  # each row once


def _stream_batches(path: Path, workers: int, keep: bool) -> list[dict[str, Any]]:
    """One epoch of `IterableBatches` (2 partitions: the same order for 0 and 2 workers), each
    batch kept whole (`keep`) or reduced to its samples (`ids`: each row whole) as it comes."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from batchctl.torch import IterableBatches

    stream = IterableBatches(path, batch_size=6, mix=4, seed=3, partitions=2)
    out = []
    for batch in DataLoader(stream, batch_size=None, num_workers=workers):
        assert isinstance(batch["array"], torch.Tensor)
        out.append(batch if keep else {"ids": ids(batch), "sum": int(batch["array"].sum())})
    return out


def test_dataloader_workers_hand_batches_over_in_shared_slots(numbered: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches a worker makes in the ring's shared slots reach the loop exactly as the main
    process would make them; a batch the loop keeps is never written over (with a ring of 3
    slots and every batch kept, the rest come the ordinary way), and every slot is free again
    once the batches are gone."""
    import batchctl.torch_ring as torch_ring

    expected = _stream_batches(numbered, 0, keep=False)
    assert _stream_batches(numbered, 2, keep=False) == expected
    monkeypatch.setattr(torch_ring, "SLOTS", 3)
    kept = _stream_batches(numbered, 2, keep=True)
    assert [{"ids": ids(b), "sum": int(b["array"].sum())} for b in kept] == expected
    ring = list(torch_ring._RINGS.values())[-1]
    in_ring = [ring.slot_of(batch["array"].numpy()) for batch in kept]
    assert ring.slots == 3 and sorted(s for s in in_ring if s is not None) == [0, 1, 2]  # the rest: the usual way
    assert all(ring.busy)  # the slots of the batches still held
    del kept, in_ring
    gc.collect()
    assert not any(ring.busy)


def _doubled(batch: dict[str, Any]) -> dict[str, Any]:
    """A transform: each row's values doubled, in a new array (an augmentation's new tensor)."""
    return {**batch, "array": batch["array"] * 2}


def test_a_stream_that_remakes_batches_in_its_workers_frees_their_slots(
    numbered: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Code in the DataLoader worker may take a batch apart and send a new one (a subclass, or
    `transform=`, whose new tensors are copied into a slot to cross): the rows are right, and
    every slot is free again once the batches are gone."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from batchctl.torch import IterableBatches

    class Doubled(IterableBatches):
        def __iter__(self) -> Any:
            for batch in super().__iter__():
                yield _doubled(batch)

    import batchctl.torch_ring as torch_ring

    monkeypatch.setattr(torch_ring, "PACK_BYTES", 1)  # (these rows are tiny: a photo batch's new tensor is MBs)
    options: dict[str, Any] = {"batch_size": 6, "mix": 4, "seed": 3, "partitions": 2}
    plain = [ids(b) for b in DataLoader(IterableBatches(numbered, **options), batch_size=None)]
    subclass, transformed = Doubled(numbered, **options), IterableBatches(numbered, **options, transform=_doubled)
    for stream in (subclass, transformed):
        got, in_ring = [], 0
        for batch in DataLoader(stream, batch_size=None, num_workers=2):
            assert isinstance(batch["array"], torch.Tensor)
            got.append(ids({**batch, "array": batch["array"] // 2}))
            in_ring += cast(Any, stream._ring).slot_of(batch["array"]) is not None
        assert in_ring == (0 if stream is subclass else len(got))  # a transform's new tensors cross in slots
        del batch  # (the last one: its slot is busy while it is held)
        gc.collect()
        assert got == plain
        assert stream._ring is not None and not any(stream._ring.busy)


def test_a_batch_held_across_epochs_of_fresh_workers_is_never_written_over(numbered: Path) -> None:
    """Workers made anew each epoch are forks of the main process while it holds a batch in a
    slot: nothing of theirs frees that slot, and the batch keeps its rows."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from batchctl.torch import IterableBatches

    stream = IterableBatches(numbered, batch_size=6, mix=4, seed=3, partitions=2)
    loader = DataLoader(stream, batch_size=None, num_workers=2)  # not persistent: new workers each epoch
    held = [batch for batch in loader][-3:]
    snapshots = [batch["array"].clone() for batch in held]
    for _ in range(2):
        for batch in loader:
            ids(batch)
    assert all(torch.equal(batch["array"], snapshot) for batch, snapshot in zip(held, snapshots, strict=True))
    assert [ids(batch) for batch in held]


def test_a_kept_batch_keeps_its_memory_and_let_go_ones_are_used_again(numbered: Path) -> None:
    """Output batches are made in memory used before (`loader.POOL`), but only memory no batch
    the loop holds is in: an epoch kept whole reads the same after two more epochs."""
    from batchctl.read import loader as loader_module

    ds = batchctl.open(numbered)
    loader = ds.loader(batch_size=6, mix=4, seed=1)
    held = list(loader)
    snapshots = [batch["array"].copy() for batch in held]
    for _ in range(2):
        for batch in loader:
            ids(batch)
    del batch
    gc.collect()
    assert loader_module.POOL._kept > 0  # the later epochs' memory waits to be used again
    assert all(np.array_equal(batch["array"], snapshot) for batch, snapshot in zip(held, snapshots, strict=True))
    assert [ids(batch) for batch in held]
