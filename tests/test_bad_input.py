"""The bad-input catalogue: each case builds correctly or is skipped with its reason; none kills
the build. Plus --max-errors, files vanishing mid-build, and a full disk for real."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import struct
import subprocess
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

import batchctl
from tests.conftest import PLUGINS, processes_in_group, run_cli, start_cli, wait_for, wait_group_gone
from tests.reference import mean_abs_diff, torchvision_reference
from tests.test_faults import SLOW, assert_exactly_once, journal_lines, journal_shards

SMALL = ["--crop", "32", "--resize", "40"]


def png_header_only(path: Path, width: int, height: int) -> None:
    """A PNG whose header claims width x height pixels: a decompression bomb, opened by its size."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


@pytest.fixture
def catalogue(tmp_path: Path) -> tuple[Path, dict[str, str | None]]:
    """A folder of every bad (and awkward but good) case; value: expected reason fragment, or
    None for files that must build."""
    src = tmp_path / "catalogue"
    src.mkdir()
    rng = np.random.default_rng(7)
    rgb = Image.fromarray(rng.integers(0, 255, (60, 90, 3), dtype=np.uint8))
    rgb.save(src / "good.jpg", quality=90)
    jpeg = (src / "good.jpg").read_bytes()
    (src / "zero.jpg").write_bytes(b"")
    (src / "truncated.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    (src / "random.jpg").write_bytes(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    (src / "text.png").write_text("I am not a picture\n")
    png_header_only(src / "bomb.png", 20000, 20000)
    rgb.convert("CMYK").save(src / "cmyk.jpg")
    Image.fromarray(rng.integers(0, 65535, (50, 40)).astype(np.uint16)).save(src / "grey16.png")
    rgb.convert("P").save(src / "palette.png")
    rgb.convert("RGBA").save(src / "rgba.png")
    rgb.resize((1, 1)).save(src / "one_pixel.png")
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to view
    rgb.save(src / "exif_rotated.jpg", exif=exif, quality=95)
    rgb.save(src / "café naïve ☃.png")
    (src / "broken_link.jpg").symlink_to(src / "does-not-exist.jpg")
    (src / "loop_a.jpg").symlink_to(src / "loop_b.jpg")
    (src / "loop_b.jpg").symlink_to(src / "loop_a.jpg")
    (src / "sub").mkdir()
    (src / "sub" / "back_up").symlink_to(src)  # a folder loop: walked once, never followed again
    expected: dict[str, str | None] = {
        "good.jpg": None,
        "cmyk.jpg": None,
        "grey16.png": None,
        "palette.png": None,
        "rgba.png": None,
        "one_pixel.png": None,
        "exif_rotated.jpg": None,
        "café naïve ☃.png": None,
        "zero.jpg": "cannot identify image file",
        "truncated.jpg": "truncated",
        "random.jpg": "cannot identify",
        "text.png": "cannot identify",
        "bomb.png": "DecompressionBombError",
        "broken_link.jpg": "No such file or directory",
        "loop_a.jpg": "Too many levels of symbolic links",
        "loop_b.jpg": "Too many levels of symbolic links",
    }
    return src, expected


def test_every_catalogued_case_builds_or_is_skipped_with_its_reason(
    catalogue: tuple[Path, dict[str, str | None]], tmp_path: Path
) -> None:
    src, expected = catalogue
    out, report = tmp_path / "out.zarr", tmp_path / "r.json"
    # a catalogue of bad input: most of it bad on purpose, so a budget is given (else most skipped fails)
    result = run_cli("build", src, "-o", out, *SMALL, "--report", report, "--max-errors", "100", timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    errors = {e["source"]: e["error"] for e in json.loads(report.read_text())["errors"]}
    bad = {name: reason for name, reason in expected.items() if reason is not None}
    assert set(errors) == set(bad) | {"sub/back_up"}
    for name, reason in bad.items():
        assert reason in errors[name], (name, errors[name])
        assert f"skipped {name}: " in result.stderr
    assert "symlink loop" in errors["sub/back_up"]
    ds = batchctl.open(out)
    rows = {str(s): img for b in ds for s, img in zip(b["source"], b["image"], strict=True)}
    assert set(rows) == {name for name, reason in expected.items() if reason is None}
    for name in ("good.jpg", "cmyk.jpg", "grey16.png", "palette.png", "rgba.png", "café naïve ☃.png"):
        assert mean_abs_diff(rows[name], torchvision_reference(src / name, 40, 32)) <= 3.0, name
    with Image.open(src / "exif_rotated.jpg") as img:
        upright = ImageOps.exif_transpose(img)
        upright.save(tmp_path / "upright.png")
    assert mean_abs_diff(rows["exif_rotated.jpg"], torchvision_reference(tmp_path / "upright.png", 40, 32)) <= 3.0


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
def test_unreadable_file_is_skipped(catalogue: tuple[Path, dict[str, str | None]], tmp_path: Path) -> None:
    src, _ = catalogue
    (src / "good.jpg").chmod(0)
    result = run_cli("build", src, "-o", tmp_path / "o.zarr", *SMALL)
    assert result.returncode == 0 and "skipped good.jpg: Permission denied" in result.stderr


@pytest.mark.parametrize(("limit", "code"), [(2, 1), (3, 0)])
def test_max_errors(image_folder: Path, tmp_path: Path, limit: int, code: int) -> None:
    src = tmp_path / "src"
    shutil.copytree(image_folder / "cat", src / "cat")
    for i in range(3):
        (src / "cat" / f"bad{i}.jpg").write_bytes(b"nope")
    result = run_cli("build", src, "-o", tmp_path / "o.zarr", *SMALL, "--max-errors", str(limit))
    assert result.returncode == code, result.stderr
    if code:
        assert "more than 2 files were skipped" in result.stderr and not (tmp_path / "o.zarr").exists()


def test_files_deleted_or_replaced_during_the_build(image_folder: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(image_folder, src)
    out, report = tmp_path / "o.zarr", tmp_path / "r.json"
    args = [
        "build",
        src,
        "-o",
        out,
        "--preprocess",
        f"{PLUGINS}:slow_image",
        "--batch-size",
        "4",
        "--shard-batches",
        "1",
        "--workers",
        "2",
        "--report",
        report,
    ]
    proc = start_cli(*args)
    wait_for(lambda: journal_shards(out) >= 1)
    (src / "fish" / "img00059.png").unlink()  # dispatched last (sorted order)
    shutil.copy(src / "fish" / "img00002.jpg", src / "fish" / "img00056.jpg")
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert "skipped fish/img00059.png: No such file or directory" in stderr
    ds = batchctl.open(out)
    assert ds.num_samples == 59
    rerun = run_cli(*args)  # the replaced file's stamp changed: not up to date
    assert rerun.returncode == 0 and json.loads(report.read_text())["status"] == "complete"


@contextlib.contextmanager
def small_filesystem(path: Path, size: str) -> Iterator[bool]:
    """A real tmpfs of `size` at `path` when mounting is allowed; False otherwise."""
    path.mkdir()
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)


def test_full_disk_fails_cleanly_and_resumes_once_fixed(image_folder: Path, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    with small_filesystem(disk, "1m") as mounted:
        out = disk / "data.zarr"
        args = ["build", image_folder, "-o", out, "--batch-size", "4", "--shard-batches", "1", "--workers", "2"]
        if mounted:
            result = run_cli(*args, timeout=60)
        else:  # no mount here: a per-file size limit gives the same write failure (EFBIG)
            result = run_cli(
                *args, timeout=60, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))
            )
        assert result.returncode == 1
        assert ("No space left on device" if mounted else "File too large") in result.stderr
        assert "Traceback" not in result.stderr
        assert not out.exists()
        if mounted:
            subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        resumed = run_cli(*args, timeout=120)
        assert resumed.returncode == 0, resumed.stderr
        assert batchctl.open(out).num_samples == 60


def test_a_full_disk_while_resuming_an_incremental_build_keeps_what_it_resumes(
    image_folder: Path, tmp_path: Path
) -> None:
    """An incremental build stopped part way; its rerun fails on a full disk as it sets the resume
    up (a file size limit stands in for the disk); the run after that, with space back, resumes."""
    source = tmp_path / "source"
    shutil.copytree(image_folder, source)
    out = tmp_path / "o.zarr"
    assert run_cli("build", source, "-o", out, *SLOW).returncode == 0
    for path in sorted(source.rglob("*.*"))[::3]:
        shutil.copy(path, path.with_name("new-" + path.name))
    proc = start_cli("build", source, "-o", out, *SLOW)
    wait_for(lambda: journal_lines(out))  # the kept batches, journaled at once as the build starts
    seeded = len(journal_lines(out))
    wait_for(lambda: len(journal_lines(out)) > seeded + 1)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 143
    limit = 256  # bytes: below the journal's, so the journal cannot be written again
    full = run_cli(
        "build", source, "-o", out, *SLOW, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    )
    assert full.returncode == 1 and "File too large" in full.stderr and "Traceback" not in full.stderr
    resumed = run_cli("build", source, "-o", out, *SLOW)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming:" in resumed.stderr
    assert_exactly_once(out, {str(p.relative_to(source)) for p in source.rglob("*.*")})


@pytest.mark.parametrize("incremental", [False, True], ids=["a first build", "an incremental build"])
def test_a_finished_shard_cut_short_in_the_work_folder_is_written_again(
    image_folder: Path, tmp_path: Path, incremental: bool
) -> None:
    """A shard file the journal says is finished, cut short afterwards (a disk that lost what it
    had acknowledged): the resumed build writes its rows again (an incremental build whose copy
    of the last build's open shard is cut starts over); what it publishes verifies, every file
    once. (It published a shard without its index before.)"""
    source = tmp_path / "source"
    shutil.copytree(image_folder, source)
    out = tmp_path / "o.zarr"
    args = ["--preprocess", f"{PLUGINS}:slow_image", "--batch-size", "4", "--shard-batches", "2", "--workers", "2"]
    done_before = 0
    if incremental:  # 60 files: 7 whole shards, kept as links to the published files, and a short one, copied
        assert run_cli("build", source, "-o", out, *args).returncode == 0
        for path in sorted(source.rglob("*.*"))[::3]:
            shutil.copy(path, path.with_name("new-" + path.name))
        done_before = 7
    proc = start_cli("build", source, "-o", out, *args)
    wait_for(lambda: journal_shards(out) >= done_before + 1)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    finished = [line["shard_done"] for line in journal_lines(out) if "shard_done" in line]
    assert proc.returncode == 143 and len(finished) > done_before
    shard = finished[done_before]  # (the incremental build's: its copy of the last build's open shard)
    image = out.parent / f".{out.name}.batchctl" / "staging.zarr" / "image" / "c" / str(shard) / "0" / "0" / "0"
    assert image.stat().st_nlink == 1
    os.truncate(image, 100)  # (into its first chunk: for the incremental build, a row it kept from the last)
    resumed = run_cli("build", source, "-o", out, *args)
    assert resumed.returncode == 0, resumed.stderr
    assert ("starting over" in resumed.stderr) == incremental, resumed.stderr
    assert_exactly_once(out, {str(p.relative_to(source)) for p in source.rglob("*.*")})


def test_collator_killed_fails_cleanly(image_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "o.zarr"
    proc = start_cli("build", image_folder, "-o", out, *SLOW)
    wait_for(lambda: journal_shards(out) >= 1)
    collators = [pid for pid in processes_in_group(proc.pid) if _comm(pid) == "batchctl-collat"]
    assert len(collators) == 1
    os.kill(collators[0], signal.SIGKILL)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 1 and "the collator process died" in stderr and "Traceback" not in stderr
    assert not out.exists()
    assert wait_group_gone(proc.pid) == []
    resumed = run_cli("build", image_folder, "-o", out, *SLOW)
    assert resumed.returncode == 0 and batchctl.open(out).num_samples == 60


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
