"""The Dask engine against a real scheduler and two worker processes on loopback."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import batchctl
from batchctl.read.inspect import verify
from batchctl.run.dask_engine import plan_compaction
from batchctl.synthetic import make_image_folder
from tests.test_build import image_files

from .conftest import PLUGINS, free_port, kill_group, run_cli, start_cli, wait_for
from .test_incremental import LAYOUT, assert_same_rows, change_files, new_image, rows_by_key

pytest.importorskip("distributed")

PID_IMAGES = ["--preprocess", f"{PLUGINS}:image_and_pid", "--batch-size", "4", "--shard-batches", "2"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[int]]]:
    """`dask scheduler` and two `dask worker` processes (no nanny: the worker is the process we start)."""
    logs = tmp_path_factory.mktemp("dask")
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    procs = []

    def start(name: str, args: list[str]) -> subprocess.Popen[bytes]:
        out = open(logs / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen([sys.executable, "-m", *args], stdout=out, stderr=out, cwd=Path(__file__).parent.parent)
        procs.append(proc)
        return proc

    start("scheduler", ["distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"])
    worker_args = ["distributed.cli.dask_worker", address, "--nthreads", "1", "--no-nanny", "--no-dashboard"]
    workers = [start(f"worker{i}", [*worker_args, "--host", "127.0.0.1"]) for i in range(2)]
    try:
        from distributed import Client

        deadline = time.monotonic() + 60
        with Client(address, timeout="30s") as client:
            while len(client.scheduler_info()["workers"]) < 2:
                if time.monotonic() > deadline:
                    raise RuntimeError("the Dask workers did not join: " + (logs / "worker0.log").read_text())
                time.sleep(0.2)
        yield address, [w.pid for w in workers]
    finally:
        for proc in reversed(procs):  # workers first: without a scheduler they linger, reconnecting
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


def test_dask_cluster_preprocesses_every_file_exactly_once(
    image_folder: Path, tmp_path: Path, cluster: tuple[str, list[int]]
) -> None:
    address, worker_pids = cluster
    source = tmp_path / "src"
    subprocess.run(["cp", "-r", str(image_folder), str(source)], check=True)
    for i in range(3):  # skipped files leave groups short: their rows are spilled and compacted
        (source / "dog" / f"bad{i}.jpg").write_bytes(b"not a jpeg")
    out, local, report = tmp_path / "dask.zarr", tmp_path / "local.zarr", tmp_path / "r.json"
    result = run_cli(
        "build", source, "-o", out, *PID_IMAGES, "--engine", "dask", "--scheduler", address, "--report", report
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(report.read_text())
    assert data["status"] == "complete" and data["samples"] == 60 and len(data["errors"]) == 3
    assert run_cli("build", source, "-o", local, *PID_IMAGES, "--workers", "2").returncode == 0

    ds, ref = batchctl.open(out), batchctl.open(local)
    rows = {
        (str(s), int(i)): (img, int(pid))
        for b in ds
        for s, i, img, pid in zip(b["source"], b["source_index"], b["image"], b["pid"], strict=True)
    }
    ref_rows = {
        (str(s), int(i)): img for b in ref for s, i, img in zip(b["source"], b["source_index"], b["image"], strict=True)
    }
    assert ds.num_samples == 60 and rows.keys() == ref_rows.keys()
    for key, (image, _) in rows.items():
        np.testing.assert_array_equal(image, ref_rows[key])
    pids = {pid for _, pid in rows.values()}
    assert pids <= set(worker_pids)  # the cluster's workers did the preprocessing, not the client
    assert {int(w.rsplit(":", 1)[1]) for w in data["workers_seen"]} <= set(worker_pids)
    assert verify(out) == []
    again = run_cli("build", source, "-o", out, *PID_IMAGES, "--engine", "dask", "--scheduler", address)
    assert again.returncode == 0 and "up to date" in again.stderr


def test_dask_reruns_incrementally_three_rounds_one_interrupted(tmp_path: Path, cluster: tuple[str, list[int]]) -> None:
    address, _ = cluster
    folder = tmp_path / "data"
    make_image_folder(folder, 40, sides=(60, 120))
    slow = ["--preprocess", f"{PLUGINS}:slow_image", "--option", "delay=0.1", *LAYOUT]
    dask = ["--engine", "dask", "--scheduler", address]
    out = tmp_path / "dask.zarr"

    def fresh_rows(name: str) -> dict:
        assert run_cli("build", folder, "-o", tmp_path / name, *slow).returncode == 0
        return rows_by_key(tmp_path / name)

    assert run_cli("build", folder, "-o", out, *slow, *dask).returncode == 0
    changed = change_files(folder, 0)
    report = tmp_path / "r.json"
    result = run_cli("build", folder, "-o", out, *slow, *dask, "--report", report)
    assert result.returncode == 0, result.stderr
    data = json.loads(report.read_text())
    assert data["processed"] == len(changed["added"]) + len(changed["changed"])
    assert data["removed"]["paths"] == changed["removed"]
    assert_same_rows(rows_by_key(out), fresh_rows("fresh0.zarr"))

    change_files(folder, 1)
    for i in range(16):
        new_image(tmp_path, folder / "fish" / f"new{i}.jpg", 70 + i)
    journal = tmp_path / ".dask.zarr.batchctl" / "journal.jsonl"
    proc = start_cli("build", folder, "-o", out, *slow, *dask)
    wait_for(lambda: journal.exists() and '"group": 0' in journal.read_text(), timeout=60)
    kill_group(proc, signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    result = run_cli("build", folder, "-o", out, *slow, *dask, "--report", report)
    assert result.returncode == 0, result.stderr
    data = json.loads(report.read_text())
    assert data["resumed_samples"] >= 8 and data["added"]["count"] == 19
    assert data["processed"] <= 19 + 2 - 8  # the finished group's files were not preprocessed again
    assert_same_rows(rows_by_key(out), fresh_rows("fresh1.zarr"))
    assert verify(out) == []

    changed = change_files(folder, 2)  # a third round, after the resumed one
    result = run_cli("build", folder, "-o", out, *slow, *dask, "--report", report)
    assert result.returncode == 0, result.stderr
    data = json.loads(report.read_text())
    assert {key: data[key]["paths"] for key in ("added", "changed", "removed")} == changed
    assert data["processed"] == len(changed["added"]) + len(changed["changed"])
    assert_same_rows(rows_by_key(out), fresh_rows("fresh2.zarr"))


@pytest.mark.parametrize(
    ("full", "spilled", "shard_rows"),
    [([0, 1, 2], 0, 8), ([0, 2, 3], 5, 8), ([1, 4, 5], 20, 8), ([], 13, 8), ([3], 0, 4), ([0, 5, 6, 7], 9, 4)],
)
def test_compaction_leaves_contiguous_whole_shards(full: list[int], spilled: int, shard_rows: int) -> None:
    plan = plan_compaction(full, spilled, shard_rows)
    placed = {target for _, target in plan.moves} | ({*full} - {source for source, _ in plan.moves})
    placed |= set(plan.spill_shards)
    shards = -(-plan.total_rows // shard_rows)
    assert placed == set(range(shards))  # every final index holds exactly one shard, no gaps
    assert len(placed) == len(full) + len(plan.spill_shards)
    assert plan.total_rows == len(full) * shard_rows + spilled


def test_a_lost_worker_costs_only_its_group(image_folder: Path, tmp_path: Path, cluster: tuple[str, list[int]]) -> None:
    """Runs last: it kills one of the module's two workers; the other runs the lost group again."""
    address, _ = cluster
    victim = sorted(p.name for p in image_folder.rglob("*.*"))[7]
    marker = tmp_path / "killed-once"
    out, report = tmp_path / "lost.zarr", tmp_path / "r.json"
    args = ["--preprocess", f"{PLUGINS}:die_once", "--option", f"name={victim}", "--option", f"marker={marker}"]
    result = run_cli(
        "build",
        image_folder,
        "-o",
        out,
        *args,
        "--batch-size",
        "4",
        "--shard-batches",
        "2",
        "--engine",
        "dask",
        "--scheduler",
        address,
        "--report",
        report,
    )
    assert result.returncode == 0, result.stderr
    assert marker.exists()  # a worker really died on that file
    data = json.loads(report.read_text())
    assert data["errors"] == [] and data["samples"] == 60
    ds = batchctl.open(out)
    assert sorted(str(s) for b in ds for s in b["source"]) == sorted(image_files(image_folder))
    assert verify(out) == []


def test_ragged_fields_on_the_cluster_are_the_local_build(tmp_path: Path, cluster: tuple[str, list[int]]) -> None:
    """A ragged build on the cluster (whole shards written by the workers, short groups spilled
    and compacted, then an incremental round carrying rows) reads as, and digests as, the local one."""
    from .test_ragged import PLUGIN, assert_dataset_is_the_folder, write_docs

    address, _ = cluster
    folder = tmp_path / "docs"
    write_docs(folder, 70, seed=21)
    args = ["--preprocess", PLUGIN, "--batch-size", "8", "--shard-batches", "2"]
    dask, local = tmp_path / "dask.zarr", tmp_path / "local.zarr"
    for compression in ("zstd", "none"):
        result = run_cli(
            "build",
            folder,
            "-o",
            dask,
            *args,
            "--compression",
            compression,
            "--engine",
            "dask",
            "--scheduler",
            address,
            "--force",
        )
        assert result.returncode == 0, result.stderr
        assert run_cli("build", folder, "-o", local, *args, "--compression", compression, "--force").returncode == 0
        assert batchctl.open(dask).build_id == batchctl.open(local).build_id
    write_docs(folder, 9, seed=22, start=70)
    (folder / "doc0005.txt").write_bytes(b"changed")
    result = run_cli(
        "build", folder, "-o", dask, *args, "--compression", "none", "--engine", "dask", "--scheduler", address
    )
    assert result.returncode == 0 and "added" in result.stderr, result.stderr
    assert_dataset_is_the_folder(dask, folder)


def test_a_dask_build_of_only_bad_files_names_each_and_says_so_once(tmp_path: Path) -> None:
    """No file preprocesses: the engine says so without starting a cluster, each file is skipped
    in one line and counted, and the build's one message ends it (exit 1, nothing published)."""
    src, out, report = tmp_path / "src", tmp_path / "o.zarr", tmp_path / "r.json"
    (src / "cat").mkdir(parents=True)
    for i in range(3):
        (src / "cat" / f"bad{i}.png").write_bytes(b"not a png")
    result = run_cli("build", src, "-o", out, "--engine", "dask", "--report", report)
    assert result.returncode == 1, result.stderr
    assert sorted(line.split(":")[0] for line in result.stderr.splitlines() if line.startswith("skipped cat/")) == [
        f"skipped cat/bad{i}.png" for i in range(3)
    ]
    assert result.stderr.count("no samples were produced: all 3 files were skipped") == 1, result.stderr
    assert "Traceback" not in result.stderr and not out.exists()
    data = json.loads(report.read_text())
    assert data["status"] == "failed" and len(data["errors"]) == 3
