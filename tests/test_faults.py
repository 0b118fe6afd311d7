"""Interrupt, kill and break real builds; every time, nothing is half-published and resuming gives
an exactly-once dataset. The CLI runs in its own process group, as under a shell."""

from __future__ import annotations

import json
import random
import signal
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

import batchctl
from batchctl.read.inspect import verify
from tests.conftest import (
    PLUGINS,
    kill_group,
    processes_in_group,
    run_cli,
    start_cli,
    sweep,
    sweep_rng,
    wait_for,
    wait_group_gone,
)
from tests.stress import build_names
from tests.test_build import image_files

SLOW = ["--preprocess", f"{PLUGINS}:slow_image", "--batch-size", "4", "--shard-batches", "1", "--workers", "2"]


def journal_lines(out: Path) -> list[dict]:
    journal = out.parent / f".{out.name}.batchctl" / "journal.jsonl"
    try:
        return [json.loads(line) for line in journal.read_text().splitlines()]
    except (OSError, ValueError):
        return []


def journal_batches(out: Path) -> int:
    """Batches journaled so far (a half-filled one written again once full counts once)."""
    return len({line["batch"] for line in journal_lines(out) if "batch" in line})


def journal_shards(out: Path) -> int:
    """Shards finished (indexed) and journaled so far."""
    return sum("shard_done" in line for line in journal_lines(out))


def assert_exactly_once(out: Path, expected: set[str]) -> None:
    ds = batchctl.open(out)
    sources = [str(s) for b in ds for s in b["source"]]
    assert sorted(sources) == sorted(expected)
    assert ds.num_samples == len(expected)
    assert [str(p) for p in verify(out)] == []  # every shard file there, every checksum sound


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_stops_cleanly_and_the_rerun_resumes(image_folder: Path, tmp_path: Path, sig: int, code: int) -> None:
    out, report = tmp_path / "data.zarr", tmp_path / "report.json"
    proc = start_cli("build", image_folder, "-o", out, *SLOW, "--report", report)
    wait_for(lambda: journal_shards(out) >= 2)
    sent = time.monotonic()
    if sig == signal.SIGINT:
        kill_group(proc, sig)  # Ctrl-C reaches the whole process group
    else:
        proc.send_signal(sig)  # `kill PID` reaches the parent alone
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == code
    assert time.monotonic() - sent < 5
    assert "Traceback" not in stderr and "interrupted" in stderr
    assert wait_group_gone(proc.pid) == []
    assert build_names(proc.pid) == []
    assert not out.exists()  # nothing at OUTPUT claims to be complete
    assert json.loads(report.read_text())["status"] == "interrupted"

    result = run_cli("build", image_folder, "-o", out, *SLOW, "--report", report)
    assert result.returncode == 0, result.stderr
    data = json.loads(report.read_text())
    assert data["status"] == "complete" and 0 < data["processed"] < 60
    assert data["resumed_shards"] >= 2
    assert_exactly_once(out, image_files(image_folder))


def test_many_random_interruptions_then_exactly_once(image_folder: Path, tmp_path: Path) -> None:
    """Interrupt at random moments (seeded), with SIGINT, SIGTERM or SIGKILL of the whole group,
    resuming each time; the finished dataset holds every input exactly once."""
    rng = sweep_rng("many random interruptions")
    out = tmp_path / "data.zarr"
    parents = []
    args = ["build", image_folder, "-o", out, *SLOW, "--option", "delay=0.01"]
    for _ in range(sweep(8, 20)):
        proc = start_cli(*args)
        parents.append(proc.pid)
        time.sleep(rng.uniform(0.3, 2.0))
        sig = rng.choice([signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
        kill_group(proc, sig)
        _, stderr = proc.communicate(timeout=30)
        # the signal's own code (-2/-15: it came during interpreter start-up, before batchctl ran;
        # a shell shows 130/143 then too), or 0 when the build had finished first
        expected = {signal.SIGINT: {130, -2}, signal.SIGTERM: {143, -15}, signal.SIGKILL: {-9}}[sig]
        assert proc.returncode in {0} | expected, (sig, proc.returncode)
        assert "Traceback" not in stderr
        assert wait_group_gone(proc.pid) == []
        if proc.returncode == 0:
            break
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr
    assert_exactly_once(out, image_files(image_folder))
    assert [name for pid in parents for name in build_names(pid)] == []  # a SIGKILLed group's, swept


def test_kill_9_of_the_whole_group_then_resume(
    image_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out, report = tmp_path / "data.zarr", tmp_path / "r.json"
    # this test's own TMPDIR (short: a Unix socket's path lies in it): what the builds leave there is theirs
    temp = Path(tempfile.mkdtemp(prefix="bt", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(temp))
    proc = start_cli("build", image_folder, "-o", out, *SLOW)
    wait_for(lambda: journal_shards(out) >= 3)
    kill_group(proc, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert wait_group_gone(proc.pid) == []
    assert not out.exists()
    assert build_names(proc.pid) != []  # the resource tracker died with the group: its semaphores stay
    left = sorted(p.name for p in temp.iterdir())
    assert len(left) == 1 and left[0].startswith(f"pymp-batchctl-{proc.pid}-"), left  # the fork server's folder
    result = run_cli("build", image_folder, "-o", out, *SLOW, "--report", report)
    assert result.returncode == 0, result.stderr
    assert json.loads(report.read_text())["resumed_shards"] >= 3
    assert_exactly_once(out, image_files(image_folder))
    assert build_names(proc.pid) == []  # the killed build's semaphores were swept by the rerun
    assert list(temp.iterdir()) == []  # and its temporary folder; the rerun's own removed as it exited
    temp.rmdir()


def test_a_killed_worker_costs_only_its_file(image_folder: Path, tmp_path: Path) -> None:
    out, report = tmp_path / "data.zarr", tmp_path / "r.json"
    victim = "img00007.jpg"
    result = run_cli(
        "build",
        image_folder,
        "-o",
        out,
        "--preprocess",
        f"{PLUGINS}:crash_on",
        "--option",
        f"name={victim}",
        "--batch-size",
        "4",
        "--report",
        report,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert f"skipped dog/{victim}: the worker process preprocessing it died (signal SIGKILL)" in result.stderr
    errors = json.loads(report.read_text())["errors"]
    assert [e["source"] for e in errors] == [f"dog/{victim}"]
    assert_exactly_once(out, image_files(image_folder) - {f"dog/{victim}"})


def test_timeout_skips_a_hung_file(image_folder: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for path in sorted((image_folder / "fish").iterdir())[:6]:
        (src / path.name).write_bytes(path.read_bytes())
    out = tmp_path / "data.zarr"
    # every file sleeps 0.01 s except none: use a delay far over the timeout for all of them
    result = run_cli(
        "build",
        src,
        "-o",
        out,
        "--preprocess",
        f"{PLUGINS}:slow_image",
        "--option",
        "delay=30",
        "--timeout",
        "1",
        "--workers",
        "2",
        timeout=90,
    )
    assert result.returncode == 1  # every file timed out: nothing to publish
    named = [line for line in result.stderr.splitlines() if line.startswith("skipped img")]
    assert len(named) == 3 and all("timed out after 1 s" in line for line in named)  # then counted:
    assert "skipped 6 files: timed out after 1 s (--timeout); its worker was killed (the first" in result.stderr
    assert "no samples were produced" in result.stderr


def test_second_build_refuses_naming_the_lock_holder(image_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "data.zarr"
    first = start_cli("build", image_folder, "-o", out, *SLOW)
    try:
        wait_for(lambda: journal_shards(out) >= 1)
        started = time.monotonic()
        second = run_cli("build", image_folder, "-o", out, *SLOW)
        assert time.monotonic() - started < 5
        assert second.returncode == 1
        assert f"process {first.pid} holds" in second.stderr and ".data.zarr.batchctl.lock" in second.stderr
    finally:
        kill_group(first, signal.SIGKILL)
        first.communicate(timeout=30)
    # the killed build's lock is stale: the next build takes it over and finishes
    result = run_cli("build", image_folder, "-o", out, *SLOW)
    assert result.returncode == 0, result.stderr
    assert_exactly_once(out, image_files(image_folder))


def test_resume_with_other_options_is_refused(image_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "data.zarr"
    proc = start_cli("build", image_folder, "-o", out, *SLOW)
    wait_for(lambda: journal_shards(out) >= 1)
    kill_group(proc, signal.SIGINT)
    proc.communicate(timeout=30)
    other = [*SLOW[:-2], "--workers", "2"]
    other[other.index("--batch-size") + 1] = "8"
    result = run_cli("build", image_folder, "-o", out, *other)
    assert result.returncode == 2
    assert "batch_size was 4, now 8" in result.stderr and "--no-resume" in result.stderr
    result = run_cli("build", image_folder, "-o", out, *other, "--no-resume")
    assert result.returncode == 0, result.stderr
    assert batchctl.open(out).batch_size == 8
    assert_exactly_once(out, image_files(image_folder))


def test_up_to_date_until_something_changes(image_folder: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for path in sorted((image_folder / "cat").iterdir())[:5]:
        (src / path.name).write_bytes(path.read_bytes())
    out, report = tmp_path / "data.zarr", tmp_path / "r.json"
    args = ["build", src, "-o", out, "--crop", "16", "--resize", "16", "--report", report]
    assert run_cli(*args).returncode == 0
    again = run_cli(*args)
    assert again.returncode == 0 and "up to date" in again.stderr
    assert json.loads(report.read_text())["status"] == "up_to_date"
    assert json.loads(report.read_text())["processed"] == 0
    (src / "new.png").write_bytes((image_folder / "cat" / "img00009.png").read_bytes())
    changed = run_cli(*args)
    assert changed.returncode == 0 and json.loads(report.read_text())["status"] == "complete"
    assert batchctl.open(out).num_samples == 6
    forced = run_cli(*args, "--force")
    assert json.loads(report.read_text())["processed"] == 6 and forced.returncode == 0
    other_option = run_cli(*args[:-2], "--crop", "8", "--report", report)
    assert other_option.returncode == 0 and batchctl.open(out).fields["image"][0] == (8, 8, 3)


def test_old_dataset_stays_readable_until_the_new_one_is_complete(image_folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "data.zarr"
    assert run_cli("build", image_folder / "cat", "-o", out, "--crop", "16", "--resize", "16").returncode == 0
    proc = start_cli("build", image_folder, "-o", out, *SLOW)
    wait_for(lambda: journal_shards(out) >= 2)
    old = batchctl.open(out)  # mid-build, OUTPUT is still the old, complete dataset
    assert old.num_samples == 20 and np.asarray(old[0]["image"]).shape[1:] == (16, 16, 3)
    kill_group(proc, signal.SIGINT)
    proc.communicate(timeout=30)
    assert batchctl.open(out).num_samples == 20
    assert processes_in_group(proc.pid) == []


STREAM = ["--preprocess", f"{PLUGINS}:slow_image", "--batch-size", "4", "--shard-batches", "4", "--workers", "2"]


def test_graceful_interrupts_keep_every_sample_the_build_counted(image_folder: Path, tmp_path: Path) -> None:
    """Interrupted at random moments and resumed until done: no file is ever preprocessed twice
    (half-filled batches and open shards are kept), and the result holds every input once. Each
    run is stopped at a random moment after its journal grew (the event, not a time since start:
    on any machine every run makes progress, and files sleep, so none runs to the end at once)."""
    rng = sweep_rng("graceful interrupts")
    out, report = tmp_path / "data.zarr", tmp_path / "r.json"
    processed, runs = 0, 0
    while runs < sweep(6, 12):
        runs += 1
        before = journal_batches(out)
        proc = start_cli("build", image_folder, "-o", out, *STREAM, "--option", "delay=0.2", "--report", report)
        wait_for(lambda: journal_batches(out) > before or proc.poll() is not None)  # noqa: B023 - waited on here
        time.sleep(rng.uniform(0.0, 0.5))
        kill_group(proc, rng.choice([signal.SIGINT, signal.SIGTERM]))
        proc.communicate(timeout=30)
        assert proc.returncode in (0, 130, 143)
        data = json.loads(report.read_text())
        processed += data["processed"]
        if data["status"] == "complete":
            break
    assert runs > 2  # it was interrupted more than once
    if not out.exists():
        result = run_cli("build", image_folder, "-o", out, *STREAM, "--option", "delay=0.2", "--report", report)
        assert result.returncode == 0, result.stderr
        processed += json.loads(report.read_text())["processed"]
    assert processed <= 60  # every sample the build counted was kept: nothing done again
    assert_exactly_once(out, image_files(image_folder))


def test_sigkill_loses_about_a_second_at_most(image_folder: Path, tmp_path: Path) -> None:
    """The journal trails the batches written by about a second: a SIGKILL of the whole group
    at a random moment finds the journal at most 2 s old, and the resumed build is exactly once."""
    out = tmp_path / "data.zarr"
    proc = start_cli("build", image_folder, "-o", out, *STREAM, "--option", "delay=0.06")
    wait_for(lambda: sum("batch" in line for line in journal_lines(out)) >= 2)
    time.sleep(random.Random(7).uniform(0.2, 1.2))
    journal = out.parent / f".{out.name}.batchctl" / "journal.jsonl"
    killed_at = time.time()
    kill_group(proc, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert killed_at - journal.stat().st_mtime <= 2.0
    result = run_cli("build", image_folder, "-o", out, *STREAM, "--option", "delay=0.06")
    assert result.returncode == 0, result.stderr
    assert_exactly_once(out, image_files(image_folder))
