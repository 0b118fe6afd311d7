"""Right by default: what a new user runs first, odd inputs, and one style of error. The real CLI."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import batchctl
from batchctl.synthetic import make_image_folder
from tests.conftest import PLUGINS, run_cli
from tests.test_build import image_files

SMALL = ["--resize", "16", "--crop", "16"]


@pytest.fixture(scope="module")
def classes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An ImageNet-style folder: 3 classes of 12 small images each, sorted class by class."""
    root = tmp_path_factory.mktemp("classes") / "data"
    make_image_folder(root, 36, sides=(40, 60))
    return root


def sources_in_order(out: Path) -> list[str]:
    return [str(s) for batch in batchctl.open(out) for s in batch["source"]]


def test_the_design_cards_command_works_with_no_output_named(classes: Path, tmp_path: Path) -> None:
    src = tmp_path / "data"
    shutil.copytree(classes, src)
    result = run_cli("build", f"{src}/", "--batch-size", "8", "--workers", str(4 * os.cpu_count()), *SMALL)
    assert result.returncode == 0, result.stderr
    out = tmp_path / "data.zarr"
    assert str(out) in result.stderr
    assert sorted(sources_in_order(out)) == sorted(image_files(src))


def test_the_first_batches_mix_classes_by_default(classes: Path, tmp_path: Path) -> None:
    """An ImageNet-style folder: without options the first batch is not all class 0 (the
    order's repeatability and --seed/--sorted: tests/test_build.py)."""
    out = tmp_path / "d.zarr"
    assert run_cli("build", classes, "-o", out, "--batch-size", "8", "--workers", "1", *SMALL).returncode == 0
    assert len({s.split("/")[0] for s in sources_in_order(out)[:8]}) > 1


def test_fifos_and_sockets_are_ignored_and_counted(classes: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(classes / "cat", src)
    os.mkfifo(src / "y.jpg")
    report = tmp_path / "r.json"
    result = run_cli("build", src, "-o", tmp_path / "o.zarr", "--report", report, *SMALL, timeout=60)
    assert result.returncode == 0, result.stderr
    data = json.loads(report.read_text())
    assert data["ignored"] == {"count": 1, "paths": ["y.jpg"]} and data["samples"] == 12


def test_a_name_that_is_not_utf8_is_skipped_in_one_line(classes: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(classes / "cat", src)
    first = sorted(src.iterdir())[0]
    os.rename(first, os.path.join(os.fsencode(src), b"caf\xe9.jpg"))
    result = run_cli("build", src, "-o", tmp_path / "o.zarr", *SMALL)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert "skipped caf\\xe9.jpg: the file name is not valid UTF-8" in result.stderr
    assert batchctl.open(tmp_path / "o.zarr").num_samples == 11


def test_output_inside_source_is_never_an_input(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(5):
        (src / f"f{i}.bin").write_bytes(bytes(range(i + 8)))
    args = ["build", src, "-o", src / "out.zarr", "--preprocess", f"{PLUGINS}:raises_for_bad", "--include", "*"]
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr
    assert sorted(sources_in_order(src / "out.zarr")) == [f"f{i}.bin" for i in range(5)]
    again = run_cli(*args)
    assert again.returncode == 0 and "up to date" in again.stderr


def test_a_file_whose_worker_died_is_tried_again_by_the_next_run(classes: Path, tmp_path: Path) -> None:
    out, marker = tmp_path / "o.zarr", tmp_path / "died-once"
    victim = "img00004.jpg"
    args = ["build", classes, "-o", out, "--preprocess", f"{PLUGINS}:die_once", "--option", f"name={victim}"]
    args += ["--option", f"marker={marker}", "--workers", "2"]
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr
    assert f"skipped dog/{victim}: the worker process preprocessing it died" in first.stderr
    second = run_cli(*args)
    assert second.returncode == 0 and "up to date" not in second.stderr
    assert sorted(sources_in_order(out)) == sorted(image_files(classes))
    third = run_cli(*args)
    assert "up to date" in third.stderr


def test_a_corrupt_file_is_not_tried_again_until_it_changes(classes: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(classes / "cat", src)
    (src / "broken.jpg").write_bytes(b"not a jpeg")
    out = tmp_path / "o.zarr"
    assert run_cli("build", src, "-o", out, *SMALL).returncode == 0
    assert "up to date" in run_cli("build", src, "-o", out, *SMALL).stderr


def test_destinations_are_checked_before_any_work(classes: Path, tmp_path: Path) -> None:
    result = run_cli("build", classes, "-o", tmp_path / "o.zarr", "--report", "/nonexistent/r.json", *SMALL)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "/nonexistent" in result.stderr and not (tmp_path / "o.zarr").exists()
    assert run_cli("build", classes, "-o", tmp_path / "o.zarr", *SMALL).returncode == 0
    for target in ("/nonexistent/g.png", str(tmp_path / "x.txt")):
        result = run_cli("preview", tmp_path / "o.zarr", "-o", target)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        assert "Traceback" not in result.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_output_folder_is_one_line(classes: Path, tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    result = run_cli("build", classes, "-o", folder / "o.zarr", *SMALL)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "writable" in result.stderr


@pytest.mark.parametrize(
    "args",
    [["build"], ["build", ".", "--bogus"], ["build", ".", "--batch-size", "0"], ["nope"], ["info"]],
)
def test_usage_errors_are_one_line_exit_2(args: list[str]) -> None:
    result = run_cli(*args)
    assert result.returncode == 2
    assert result.stderr.startswith("batchctl: error: ") and result.stderr.count("\n") == 1, result.stderr


def test_build_help_reads_well_in_80_columns() -> None:
    result = run_cli("build", "--help", env={**os.environ, "COLUMNS": "80"})
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "<bool>" not in result.stdout and "…" not in result.stdout
    assert "package.module:function" in result.stdout.replace("\n", " ")


def test_16_bit_and_float_images_keep_their_picture(tmp_path: Path) -> None:
    from PIL import Image

    src = tmp_path / "src"
    src.mkdir()
    ramp = np.linspace(0, 65535, 64 * 64).reshape(64, 64)
    Image.fromarray(ramp.astype(np.uint16)).save(src / "grey16.png")
    Image.fromarray(ramp.astype(np.int32), mode="I").save(src / "int32.tif")
    Image.fromarray((ramp / 65535).astype(np.float32), mode="F").save(src / "float.tif")
    out = tmp_path / "o.zarr"
    result = run_cli("build", src, "-o", out, "--resize", "64", "--crop", "64")
    assert result.returncode == 0, result.stderr
    ds = batchctl.open(out)
    expected = (ramp / 257).round()
    for i in range(ds.num_samples):
        row = ds.sample(i)
        pixels = np.asarray(row["image"], np.float64)[..., 0]
        assert pixels.std() > 50, row["source"]  # not flat white
        assert np.abs(pixels - expected).mean() < 3, row["source"]


def test_a_plugins_big_endian_field_is_stored_little_endian(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"f{i}.bin").write_bytes(bytes(range(i + 10)))
    out = tmp_path / "o.zarr"
    result = run_cli("build", src, "-o", out, "--preprocess", f"{PLUGINS}:big_endian", "--include", "*.bin")
    assert result.returncode == 0, result.stderr
    assert "0 skipped" in result.stderr
    ds = batchctl.open(out)
    assert ds.num_samples == 6
    row = ds.sample(0)
    assert np.asarray(row["be"]).dtype.str == "<f4"
    assert np.asarray(row["be"]).tolist() == [float(len(str(row["source"])))] * 6


@pytest.mark.parametrize(
    ("extra", "named"),
    [(["--option", "lenght=48"], "lenght"), (["--resize", "32"], "resize")],
)
def test_an_option_the_plugin_does_not_take_is_refused_before_any_work(
    classes: Path, tmp_path: Path, extra: list[str], named: str
) -> None:
    out = tmp_path / "o.zarr"
    result = run_cli("build", classes, "-o", out, "--preprocess", f"{PLUGINS}:slow_image", *extra)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and named in result.stderr and "crop, delay" in result.stderr
    assert not out.exists() and not (tmp_path / ".o.zarr.batchctl").exists()


def test_a_plugin_declares_the_files_it_takes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / f"f{i}.bin").write_bytes(bytes(i + 1))
    (src / "README.md").write_text("about these files")
    report = tmp_path / "r.json"
    plugin = f"{PLUGINS}:bin_length"
    result = run_cli("build", src, "-o", tmp_path / "o.zarr", "--preprocess", plugin, "--report", report)
    assert result.returncode == 0, result.stderr
    data = json.loads(report.read_text())
    assert data["samples"] == 3 and data["ignored"] == {"count": 1, "paths": ["README.md"]} and data["errors"] == []
