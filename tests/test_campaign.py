"""The fault campaign's cases, each as a user meets it: one clean line, or nothing left behind.

A ragged field of other trailing dimensions, DataLoader streams made and dropped again and
again, odd split fractions, mixture weights and epoch sizes, and torchrun's environment without a
process group.
"""

from __future__ import annotations

import gc
import math
import os
from pathlib import Path

import numpy as np
import pytest

import batchctl
from tests.conftest import PLUGINS, run_cli
from tests.test_loader import make_numbered


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("campaign")
    make_numbered(root / "src", 0, 60, 3)
    out = root / "small.zarr"
    result = run_cli("build", root / "src", "-o", out, "--preprocess", "npy", "--batch-size", "8")
    assert result.returncode == 0, result.stderr
    return out


def test_a_ragged_field_of_other_trailing_dimensions_is_one_skip_naming_the_file(tmp_path: Path) -> None:
    """Tiny files travel many to a message: the odd one is still skipped alone, with both shapes."""
    folder = tmp_path / "docs"
    folder.mkdir()
    for n in range(300):
        (folder / f"d{n:03d}.txt").write_text(f"document {n}")
    (folder / "plane.txt").write_text("xy" * 7)
    out = tmp_path / "docs.zarr"
    args = ("--preprocess", f"{PLUGINS}:ragged_points", "--batch-size", "4", "--workers", "2", "--sorted")
    result = run_cli("build", folder, "-o", out, *args)
    assert result.returncode == 0, result.stderr
    assert "skipped plane.txt: field 'points' is (n, 2) float32, the dataset's is (n,) float32" in result.stderr
    assert "Traceback" not in result.stderr
    ds = batchctl.open(out)
    assert ds.num_samples == 300
    sources = {str(s) for batch in ds.loader(batch_size=50, drop_last=False) for s in batch["source"]}
    assert sources == {f"d{n:03d}.txt" for n in range(300)}


def _descriptors() -> tuple[int, int]:
    """This process's open descriptors, and how many of them are batchctl's batch rings."""
    links = []
    for name in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{name}"))
        except OSError:
            continue
    return len(links), sum("memfd:batchctl" in link for link in links)


def test_streams_broken_off_early_and_dropped_leak_no_descriptor_or_memory(small: Path) -> None:
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from batchctl.torch import IterableBatches

    counts = []
    for _ in range(12):
        stream = IterableBatches(small, batch_size=4)
        batch = next(iter(DataLoader(stream, batch_size=None, num_workers=2)))  # the rest left unread
        del batch, stream
        gc.collect()
        counts.append(_descriptors())
    assert counts[-1] == counts[1], counts  # flat (was 3 descriptors, 2 of them memfds, a cycle)
    assert counts[-1][1] == 0


@pytest.mark.parametrize("fractions", [{"train": math.nan, "val": 0.5}, {"a": math.inf}, {"a": "0.5"}, {"a": True}])
def test_split_fractions_that_are_not_numbers_are_refused(small: Path, fractions: dict[str, object]) -> None:
    with pytest.raises(batchctl.UsageError, match="Expected fractions") as refused:
        batchctl.open(small).split(fractions)  # type: ignore[arg-type]
    assert "\n" not in str(refused.value)


def test_mixture_weights_and_epoch_sizes_at_their_limits(small: Path) -> None:
    ds = batchctl.open(small)
    for weight in (math.inf, math.nan, -1.0):
        with pytest.raises(batchctl.UsageError, match="Expected finite weights > 0"):
            batchctl.mix({"a": ds, "b": ds}, {"a": 1, "b": weight}, batch_size=16)
    huge = batchctl.mix({"a": ds, "b": ds}, {"a": 1e308, "b": 1e308}, batch_size=16)
    assert len(next(iter(huge))["dataset"]) == 16  # (the weights' sum overflowed: 2 rows a batch)
    for size in (2**62, 2**70):
        with pytest.raises(batchctl.UsageError, match="epoch_size"):
            batchctl.mix({"a": ds, "b": ds}, {"a": 1, "b": 1}, batch_size=16, epoch_size=size)
    long = batchctl.mix({"a": ds, "b": ds}, {"a": 1, "b": 1}, batch_size=16, epoch_size=10**18)
    first = next(iter(long))  # an epoch far longer than memory: planned a window at a time
    assert len(first["dataset"]) == 16 and sorted(np.unique(first["dataset"]).tolist()) == [0, 1]
    assert len(long) == 10**18 // 16 - 1  # the steps left


def test_iterable_batches_takes_torchruns_environment_without_a_process_group(
    small: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch")
    from batchctl.torch import IterableBatches

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    stream = IterableBatches(small, batch_size=4)
    assert (stream.rank, stream.world_size) == (1, 2)
    assert IterableBatches(small, batch_size=4, rank=0, world_size=1).world_size == 1  # given: as given
    monkeypatch.setenv("RANK", "5")
    with pytest.raises(batchctl.UsageError, match="rank 5, world_size 2") as refused:
        IterableBatches(small, batch_size=4)
    assert "\n" not in str(refused.value)
