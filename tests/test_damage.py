"""Damaged and replaced datasets: missing data is an error naming what is missing, never zeros;
a reader held across a rebuild never mixes versions; every command says so in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr

import batchctl
from tests.conftest import run_cli
from tests.test_build import image_files

ARGS = ["--batch-size", "8", "--shard-batches", "2", "--crop", "16", "--resize", "16", "--workers", "2"]


@pytest.fixture(scope="module")
def built(image_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("damage") / "data.zarr"
    result = run_cli("build", image_folder, "-o", out, *ARGS, "--compression", "zstd")
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture
def copy(built: Path, tmp_path: Path) -> Path:
    target = tmp_path / "data.zarr"
    shutil.copytree(built, target)
    return target


def one_line_exit_1(*args: str | Path) -> str:
    result = run_cli(*args)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1, result.stderr
    return result.stderr


def test_a_missing_shard_is_an_error_naming_it(copy: Path) -> None:
    (copy / "image" / "c" / "1" / "0" / "0" / "0").unlink()
    ds = batchctl.open(copy)
    assert ds[0]["image"].shape == (8, 16, 16, 3)  # shard 0 is there
    with pytest.raises(batchctl.FormatError, match="image shard 1 is missing"):
        ds[2]
    with pytest.raises(batchctl.FormatError, match="image shard 1"):
        list(ds.iter_batches())
    with pytest.raises(batchctl.FormatError, match="image shard 1"):
        ds.sample(20)


def test_an_array_whose_metadata_is_gone_is_refused(copy: Path) -> None:
    (copy / "label" / "zarr.json").unlink()
    with pytest.raises(batchctl.FormatError, match="'label' is missing"):
        batchctl.open(copy)
    assert "'label' is missing" in one_line_exit_1("verify", copy)


def test_ragged_arrays_are_refused(copy: Path) -> None:
    group = zarr.open_group(str(copy), mode="r+")
    arr = group["source_index"]
    arr.resize((arr.shape[0] - 3,))
    with pytest.raises(batchctl.FormatError, match="disagree on the number of rows"):
        batchctl.open(copy)
    one_line_exit_1("info", copy)


def test_a_corrupt_group_metadata_is_one_line_everywhere(copy: Path) -> None:
    (copy / "zarr.json").write_text('{"zarr_format": 3, "node_type": "gro')
    for command in ("verify", "info"):
        assert "zarr.json is damaged" in one_line_exit_1(command, copy)
    with pytest.raises(batchctl.FormatError):
        batchctl.open(copy)


def test_info_on_a_damaged_shard_is_one_line(copy: Path) -> None:
    shard = copy / "label" / "c" / "0"
    data = bytearray(shard.read_bytes())
    data[2:10] = bytes(8)
    shard.write_bytes(bytes(data))
    assert "label" in one_line_exit_1("info", copy)


def test_info_lists_skipped_files_and_counts_right(image_folder: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(image_folder / "cat", src)
    (src / "broken.jpg").write_bytes(b"not a jpeg")
    out = tmp_path / "o.zarr"
    small = ["--batch-size", "64", "--compression", "none", "--resize", "16", "--crop", "16"]
    built = run_cli("build", src, "-o", out, *small)
    assert built.returncode == 0, built.stderr
    assert "1 shard," in built.stderr and "20 samples in 1 batch," in built.stderr
    result = run_cli("info", out)
    assert result.returncode == 0, result.stderr
    assert "1 batch of 64 (holding 20), 1 shard (up to" in result.stdout  # 20 samples: a short batch
    assert "broken.jpg: " in result.stdout
    data = json.loads(run_cli("info", out, "--json").stdout)
    assert [entry["source"] for entry in data["skipped"]] == ["broken.jpg"]
    assert 0.95 <= data["fields"]["image"]["ratio"] <= 1.0  # stored raw: the padded batch is no loss


def test_a_reader_held_across_a_rebuild_never_mixes_versions(image_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "data.zarr"
    assert run_cli("build", image_folder, "-o", out, *ARGS).returncode == 0
    ds = batchctl.open(out)
    before = [ds[i] for i in range(ds.num_batches)]
    ds = batchctl.open(out)
    first = ds[0]  # one shard opened before the rebuild
    assert np.array_equal(first["image"], before[0]["image"])
    rebuilt = run_cli("build", image_folder, "-o", out, *ARGS[:-4], "--crop", "12", "--resize", "12", "--workers", "1")
    assert rebuilt.returncode == 0, rebuilt.stderr
    replaced = 0
    for i in range(ds.num_batches):
        try:
            batch = ds[i]
        except batchctl.DatasetReplacedError:
            replaced += 1
            continue
        assert batch["image"].shape[1:] == (16, 16, 3)
        assert all(np.array_equal(batch[name], before[i][name]) for name in batch), i
    assert replaced > 0  # shards not opened before the rebuild are gone with the old version
    fresh = batchctl.open(out)
    assert fresh[0]["image"].shape[1:] == (12, 12, 3)
    assert sorted(str(s) for b in fresh for s in b["source"]) == sorted(image_files(image_folder))
