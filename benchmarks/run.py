"""`make bench`: batchctl against a serial loop and a naive Pool baseline, side by side, one run.

Workloads (generated, nothing downloaded): photo-like JPEG/PNG images in class folders; many tiny
.npy files (per-sample overhead); one big .npy split into rows. Reports samples/s, the ratio to
the ideal W x r (r = the serial loop's rate), peak RSS summed over the whole process tree, bytes
written. Results go to benchmarks/results/latest.json and a PNG plot.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from batchctl.preprocess.image import preprocess_image
from batchctl.synthetic import make_image_folder

HERE = Path(__file__).resolve().parent
CORES = len(os.sched_getaffinity(0))
PR_SET_CHILD_SUBREAPER = 36


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and all its descendants (walked through /proc/PID/task/*/children,
    so sampling costs little CPU next to the build it measures)."""
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        try:
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{current}/task").iterdir():
                stack.extend(int(child) for child in (task / "children").read_text().split())
        except OSError:
            continue
    return total


TICK_S = 1 / os.sysconf("SC_CLK_TCK")


Threads = dict[tuple[int, int], tuple[str, float]]


def tree_threads(pid: int, into: Threads) -> None:
    """CPU seconds so far of every thread of `pid` and its descendants, by (pid, tid), with its
    role ("parent", or the process's name; "/main" for a process's main thread, else the thread's
    name); a thread that has ended keeps its last figure."""
    stack = [pid]
    while stack:
        current = stack.pop()
        try:
            process = "parent" if current == pid else Path(f"/proc/{current}/comm").read_text().strip()
            for task in Path(f"/proc/{current}/task").iterdir():
                stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
                thread = "main" if int(task.name) == current else (task / "comm").read_text().strip()
                into[(current, int(task.name))] = (f"{process}/{thread}", (int(stat[11]) + int(stat[12])) * TICK_S)
                stack.extend(int(child) for child in (task / "children").read_text().split())
        except OSError:
            continue


def role_cpu(threads: Threads) -> dict[str, float]:
    """CPU seconds per role: the mean over the worker processes' main threads, the busiest thread
    of any other role (several writer threads share one)."""
    totals: dict[str, list[float]] = {}
    for role, cpu in threads.values():
        totals.setdefault(role, []).append(cpu)
    return {
        role: sum(cpus) / len(cpus) if role == "batchctl-worker/main" else max(cpus) for role, cpus in totals.items()
    }


def serial_fraction(n: Threads, more: Threads, times: int) -> dict[str, Any]:
    """The busiest thread other than the workers' preprocessing threads, as a fraction of one
    worker's CPU, per N files added (`more` had (1 + `times`) x N files; start-up left out): what
    caps a build at 1/fraction workers however many cores there are."""
    small, big = role_cpu(n), role_cpu(more)
    marginal = {role: (big[role] - small.get(role, 0.0)) / times for role in big}
    worker = marginal.pop("batchctl-worker/main", 0.0)
    busiest = max(marginal, key=lambda role: marginal[role], default="")
    return {
        "worker_cpu_s_per_n_files": round(worker, 3),
        "busiest_other_thread": busiest,
        "busiest_other_cpu_s_per_n_files": round(marginal.get(busiest, 0.0), 3),
        "serial_fraction": round(marginal.get(busiest, 0.0) / worker, 4) if worker else None,
        "all_roles_cpu_s_per_n_files": {role: round(cpu, 3) for role, cpu in sorted(marginal.items())},
    }


def become_subreaper() -> None:
    """Make this process the reaper of its orphaned descendants (Linux), so that the CPU of every
    process a command starts (the fork server and its children outlive their parent by a moment)
    is counted in this process's RUSAGE_CHILDREN once they are reaped (`tree_cpu_s`)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _children() -> set[int]:
    """This process's children (orphans reparented to it included)."""
    pids: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            pids.update(int(pid) for pid in (task / "children").read_text().split())
    return pids


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def tree_cpu_s(cmd: list[str]) -> tuple[float, float]:
    """Wall time and CPU seconds (user + system) of a command and all its descendants: those
    that outlive it (its fork server and resource tracker, for a moment) are reaped here, and
    only those (this process's own helpers, such as its resource tracker, live on)."""
    os.sync()
    ours = _children()
    before = _children_cpu_s()
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    for pid in _children() - ours:  # they closed the output pipes: gone, or about to be
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    return elapsed, _children_cpu_s() - before


def run_measured(
    cmd: list[str], threads: Threads | None = None, env: dict[str, str] | None = None
) -> tuple[float, int, subprocess.CompletedProcess[str]]:
    """Wall time and peak tree RSS of a command (and, given `threads`, each thread's CPU); each
    starts with no dirty pages left by the one before (its writeback would otherwise slow the
    next run: 2 workers measured 0.6x of 1)."""
    os.sync()
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}
    )
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, tree_rss(proc.pid))
            if threads is not None:
                tree_threads(proc.pid, threads)
            stop.wait(0.1 if threads is not None else 0.2)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    out, err = proc.communicate()
    elapsed = time.perf_counter() - start
    stop.set()
    thread.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err}")
    return elapsed, peak, subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def serial_rate(files: list[Path], fn: Any) -> float:
    start = time.perf_counter()
    for path in files:
        fn(path)
    return len(files) / (time.perf_counter() - start)


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def linked_copies(src: Path, dest: Path, times: int) -> None:
    """`times` hard links of every file of `src` under `dest`, in the same folders: a set
    `times` as big for nothing (the same files under other names)."""
    for path in src.rglob("*"):
        if path.is_file():
            folder = dest / path.parent.relative_to(src)
            folder.mkdir(parents=True, exist_ok=True)
            for k in range(times):
                os.link(path, folder / f"{k}_{path.name}")


def batchctl_cmd(src: Path, out: Path, workers: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "batchctl",
        "build",
        str(src),
        "-o",
        str(out),
        "--workers",
        str(workers),
        "--force",
        "--quiet",
        *extra,
    ]


def baseline_cmd(function: str, src: Path, out: Path) -> list[str]:
    """A baseline of this module, run over SRC's files as a process of its own, as a user's script is."""
    code = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); import run; from pathlib import Path; "
        f"run.{function}(sorted(p for p in Path({str(src)!r}).rglob('*') if p.is_file()), Path({str(out)!r}), {CORES})"
    )
    return [sys.executable, "-c", code]


def naive_pool(files: list[Path], out: Path, workers: int) -> None:
    """The baseline users write first: Pool.imap, keep everything, write one array at the end."""
    import zarr

    with get_context("forkserver").Pool(workers) as pool:
        images = [r["image"] for r in pool.imap(preprocess_image, files, chunksize=4)]
    stacked = np.stack(images)
    zarr.save_array(str(out), stacked)


def _save_batch(job: tuple[Path, int, list[Path]]) -> int:
    out, number, paths = job
    np.save(out / f"batch{number:05d}.npy", np.stack([preprocess_image(path)["image"] for path in paths]))
    return len(paths)


def fifty_line_design(files: list[Path], out: Path, workers: int) -> None:
    """The 50-line Pool baseline: `Pool.imap_unordered`, one task per 64 files, each worker
    `np.save`s its batch (no labels, sources, checksums, journal or fsync): what a throwaway
    script gets on this machine, the yardstick of the photo goal."""
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(out, number, files[start : start + 64]) for number, start in enumerate(range(0, len(files), 64))]
    with get_context("forkserver").Pool(workers) as pool:
        assert sum(pool.imap_unordered(_save_batch, jobs)) == len(files)


def _preprocess_only(path: Path) -> None:
    preprocess_image(path)


def parallel_ceiling(files: list[Path], workers: int) -> float:
    """What this machine gives W processes running the preprocessing alone, keeping nothing: the
    most any tool could reach here (a shared VM's second core is not always a whole core)."""
    with get_context("forkserver").Pool(workers) as pool:
        pool.map(_preprocess_only, files[:workers])  # started and warm before the clock runs
        start = time.perf_counter()
        pool.map(_preprocess_only, files, chunksize=16)
        return len(files) / (time.perf_counter() - start)


def rate_row(
    tool: str, workers: int, rate: float, r: float, peak: int | None = None, out: Path | None = None
) -> dict[str, Any]:
    """One row of the image table: samples/s and its ratio to the ideal W x r, and, when measured,
    the peak RSS of the whole process tree and the bytes written."""
    row: dict[str, Any] = {
        "tool": tool,
        "workers": workers,
        "samples_per_s": round(rate, 1),
        "ratio_to_ideal": round(rate / (workers * r), 3),
    }
    if peak is not None:
        row["peak_rss_mib"] = round(peak / 2**20, 1)
    if out is not None:
        row["bytes"] = du(out)
    return row


PAIRED_ROUNDS = 3


def bench_images(root: Path, count: int, results: dict[str, Any]) -> None:
    src = root / "images"
    make_image_folder(src, count, sides=(300, 900))
    files = sorted(p for p in src.rglob("*") if p.is_file())
    r = serial_rate(files, preprocess_image)
    rows: list[dict[str, Any]] = [{"tool": "serial loop", "workers": 1, "samples_per_s": round(r, 1)}]
    for workers in range(1, CORES):
        out = root / f"img{workers}.zarr"
        elapsed, peak, _ = run_measured(batchctl_cmd(src, out, workers))
        rows.append(rate_row("batchctl build", workers, count / elapsed, r, peak, out))
    # batchctl on every core and the 50-line design: alternated rounds, medians, each run into an
    # empty folder (this machine's speed moves by a fifth from one run to the next)
    ours, fifty = root / f"img{CORES}.zarr", root / "fifty"
    paired: dict[Path, list[tuple[float, int]]] = {ours: [], fifty: []}
    commands = {ours: batchctl_cmd(src, ours, CORES), fifty: baseline_cmd("fifty_line_design", src, fifty)}
    for _ in range(PAIRED_ROUNDS):
        for out, cmd in commands.items():
            shutil.rmtree(out, ignore_errors=True)
            elapsed, peak, _ = run_measured(cmd)
            paired[out].append((elapsed, peak))
    elapsed = statistics.median(e for e, _ in paired[ours])
    rows.append(rate_row("batchctl build", CORES, count / elapsed, r, max(p for _, p in paired[ours]), ours))
    rows.append(rate_row("preprocessing only (ceiling)", CORES, parallel_ceiling(files, CORES), r))
    elapsed, peak, _ = run_measured(baseline_cmd("naive_pool", src, root / "naive.zarr"))
    rows.append(rate_row("naive Pool.imap + write at end", CORES, count / elapsed, r, peak, root / "naive.zarr"))
    elapsed = statistics.median(e for e, _ in paired[fifty])
    tool = "the 50-line Pool baseline (imap_unordered, np.save per 64 files)"
    rows.append(rate_row(tool, CORES, count / elapsed, r, max(p for _, p in paired[fifty]), fifty))
    rows += litdata_rows(root, src, count, r)
    # memory: N vs 4N files of the same kind (hard links to the same images under other names)
    big = root / "images4x"
    linked_copies(src, big, 4)
    threads_n: Threads = {}
    threads_4n: Threads = {}
    elapsed_n, peak_n, _ = run_measured(batchctl_cmd(src, root / "mem1.zarr", CORES), threads_n)
    elapsed_4n, peak_4n, _ = run_measured(batchctl_cmd(big, root / "mem4.zarr", CORES), threads_4n)
    steady = 3 * count / (elapsed_4n - elapsed_n)  # from N to 4N files: start-up and tail left out
    results["images"] = {
        "files": count,
        "serial_rate": round(r, 1),
        "rows": rows,
        "threads": {"workers": CORES, "files_n": count, **serial_fraction(threads_n, threads_4n, 3)},
        "steady": {
            "workers": CORES,
            "samples_per_s": round(steady, 1),
            "ratio_to_ideal": round(steady / (CORES * r), 3),
            "fixed_cost_s": round(elapsed_n - count / steady, 2),
        },
        "memory": {
            "files_n": count,
            "peak_rss_n_mib": round(peak_n / 2**20, 1),
            "files_4n": 4 * count,
            "peak_rss_4n_mib": round(peak_4n / 2**20, 1),
            "growth": round(peak_4n / peak_n - 1, 3),
        },
    }


LITDATA_JOB = """
import sys, time
from pathlib import Path

import numpy as np
from litdata import optimize

from batchctl.preprocess.image import preprocess_image

SRC = Path(sys.argv[1])
CLASSES = sorted(p.name for p in SRC.iterdir() if p.is_dir())


def sample(path):  # what batchctl stores per row: the image, its label and its source
    image = preprocess_image(Path(path))["image"]
    rel = Path(path).relative_to(SRC)
    return {"image": image, "label": CLASSES.index(rel.parts[0]), "source": rel.as_posix()}


if __name__ == "__main__":
    files = sorted(str(p) for p in SRC.rglob("*") if p.is_file())
    started = time.perf_counter()
    optimize(fn=sample, inputs=files, output_dir=sys.argv[2], num_workers=int(sys.argv[3]), chunk_bytes="128MB")
    print("OPTIMIZE_S", time.perf_counter() - started)
"""


def litdata_seconds(root: Path, src: Path, out: Path) -> tuple[float, float, int] | None:
    """LitData's `optimize()` on SRC's files with the same preprocessing and CORES workers: the
    whole process's seconds, the call's alone and the peak RSS; None when LitData is not installed
    (`pip install torch==2.13.0 litdata`, torch pinned first: unpinned, it pulls several GB)."""
    try:
        import litdata  # noqa: F401
    except ImportError:
        print("[info] LitData is not installed here: its rows are left out (pip install torch==2.13.0 litdata)")
        return None
    job = root / "litdata_job.py"
    job.write_text(LITDATA_JOB)
    elapsed, peak, proc = run_measured([sys.executable, str(job), str(src), str(out), str(CORES)])
    call = float(next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("OPTIMIZE_S")))
    return elapsed, call, peak


def litdata_rows(root: Path, src: Path, count: int, r: float) -> list[dict[str, Any]]:
    out = root / "litdata_out"
    found = litdata_seconds(root, src, out)
    if found is None:
        return []
    elapsed, call, peak = found
    return [
        rate_row("LitData optimize() (whole process)", CORES, count / elapsed, r, peak, out),
        rate_row("LitData optimize() (the call alone)", CORES, count / call, r),
    ]


def bench_tiny(root: Path, count: int, results: dict[str, Any]) -> None:
    """Many tiny .npy files: end to end on `count` files, and the marginal rate from `count` to
    2 x `count` files (hard links under other names), which leaves out the fixed start-up cost."""
    src = root / "tiny"
    src.mkdir()
    rng = np.random.default_rng(0)
    for i in range(count):
        np.save(src / f"{i:06d}.npy", rng.random(16, dtype=np.float32))
    double = root / "tiny2x"
    double.mkdir()
    for path in src.iterdir():
        os.link(path, double / path.name)
        os.link(path, double / f"b{path.name}")
    from batchctl.preprocess.npy import preprocess_npy

    files = sorted(src.iterdir())
    r = serial_rate(files, preprocess_npy)
    args = ("--preprocess", "npy", "--batch-size", "256")
    elapsed, peak, _ = run_measured(batchctl_cmd(src, root / "tiny.zarr", CORES, *args))
    elapsed_2x, _, _ = run_measured(batchctl_cmd(double, root / "tiny2x.zarr", CORES, *args))
    # CPU of every process, from N to 2N files (start-up left out), less the per-file function's
    _, cpu = tree_cpu_s(batchctl_cmd(src, root / "tiny_cpu.zarr", CORES, *args))
    _, cpu_2x = tree_cpu_s(batchctl_cmd(double, root / "tiny2x_cpu.zarr", CORES, *args))
    per_file_us = (cpu_2x - cpu) / count * 1e6
    results["tiny"] = {
        "files": count,
        "serial_rate": round(r, 1),
        "samples_per_s": round(count / elapsed, 1),
        "marginal_samples_per_s": round(count / (elapsed_2x - elapsed), 1),
        "fixed_cost_s": round(2 * elapsed - elapsed_2x, 2),
        "peak_rss_mib": round(peak / 2**20, 1),
        "cpu_us_per_file": round(per_file_us, 1),
        "cpu_us_per_file_beyond_fn": round(per_file_us - 1e6 / r, 1),
    }


def bench_startup(root: Path, results: dict[str, Any]) -> None:
    """Fixed costs, side by side: `python -c "import numpy, PIL.Image"`, a build of 10 small
    images, and an up-to-date rerun over 10,000 tiny files (best of three each)."""
    ten, many = root / "start_ten", root / "start_many"
    make_image_folder(ten, 10, sides=(64, 96), seed=3)
    many.mkdir()
    for i in range(10_000):
        np.save(many / f"{i:05d}.npy", np.zeros(4, np.float32))
    build = [sys.executable, "-m", "batchctl", "build", "--quiet", "--workers", str(CORES)]

    def best(make_cmd: Any) -> float:
        return min(run_measured(make_cmd(n))[0] for n in range(3))

    imports = best(lambda n: [sys.executable, "-c", "import numpy, PIL.Image"])
    ten_images = best(lambda n: [*build, str(ten), "-o", str(root / f"start_ten{n}.zarr")])
    run_measured([*build, str(many), "-o", str(root / "start_many.zarr"), "--preprocess", "npy"])
    rerun = best(lambda n: [*build, str(many), "-o", str(root / "start_many.zarr"), "--preprocess", "npy"])
    results["startup"] = {
        "import_numpy_pil_s": round(imports, 3),
        "build_10_images_s": round(ten_images, 3),
        "up_to_date_10000_files_s": round(rerun, 3),
    }


def bench_incremental(root: Path, count: int, results: dict[str, Any]) -> None:
    """A rerun after 1% of the files were added (then removed, then changed), against the full
    build of the same folder and against start-up (a build of 10 small images), side by side."""
    src = root / "grow"
    make_image_folder(src, count, sides=(300, 900), seed=1)
    tiny = root / "ten"
    make_image_folder(tiny, 10, sides=(64, 96), seed=2)
    out = root / "grow.zarr"

    def build(folder: Path, target: Path) -> tuple[float, dict[str, Any]]:
        report = root / "incremental-report.json"
        cmd = [sys.executable, "-m", "batchctl", "build", str(folder), "-o", str(target), "--quiet"]
        elapsed, _, _ = run_measured([*cmd, "--workers", str(CORES), "--report", str(report)])
        return elapsed, json.loads(report.read_text())

    startup = min(build(tiny, root / f"ten{n}.zarr")[0] for n in range(3))  # best of three, as the full build
    full, _ = build(src, out)  # one run: several seconds, the noise is small beside it
    files = sorted(p for p in src.rglob("*") if p.is_file())
    step = max(1, count // 100)
    rows: list[dict[str, Any]] = []
    added = []
    for i, path in enumerate(files[:step]):  # 1% new files (the same pictures under new names)
        target = path.with_name(f"new{i}_{path.name}")
        shutil.copyfile(path, target)
        added.append(target)
    for change, act in (
        ("add 1%", lambda: None),
        ("remove 1%", lambda: [p.unlink() for p in files[step : 2 * step]]),
        ("change 1%", lambda: [os.utime(p, ns=(p.stat().st_atime_ns, time.time_ns())) for p in files[-step:]]),
    ):
        act()
        elapsed, report = build(src, out)
        rows.append(
            {
                "change": change,
                "seconds": round(elapsed, 2),
                "processed": report["processed"],
                "kept_samples": report["kept_samples"],
                "over_startup_of_full": round((elapsed - startup) / full, 4),
            }
        )
    results["incremental"] = {
        "files": count,
        "full_build_s": round(full, 2),
        "startup_s": round(startup, 2),
        "reruns": rows,
    }


def split_file_speedup(root: Path, name: str, make: Any, size: int, args: tuple[str, ...], unit: int) -> dict[str, Any]:
    """One big file built with 1 and W workers: samples/s end to end, and the speedup net of the
    ~1 s start-up, measured with a file of the same kind 1/1000 the size (a 2-core build of a
    few seconds is otherwise half start-up)."""
    big, small = root / f"{name}_big", root / f"{name}_small"
    make(big, size)
    make(small, max(1, size // 1000))
    result: dict[str, Any] = {"samples_per_s": {}, "net_seconds": {}}
    for workers in (1, CORES):
        elapsed, _, _ = run_measured(batchctl_cmd(big, root / f"{name}{workers}.zarr", workers, *args))
        fixed, _, _ = run_measured(batchctl_cmd(small, root / f"{name}{workers}s.zarr", workers, *args))
        result["samples_per_s"][str(workers)] = round(size * unit / elapsed, 1)
        result["net_seconds"][str(workers)] = round(max(elapsed - fixed, 1e-3), 2)
    result["output_bytes"] = du(root / f"{name}1.zarr")
    result["disk_write_s"] = round(disk_write_seconds(root, result["output_bytes"]), 2)
    end_to_end = result["samples_per_s"][str(CORES)] / result["samples_per_s"]["1"]
    result["speedup"] = round(end_to_end, 2)
    result["net_speedup"] = round(result["net_seconds"]["1"] / result["net_seconds"][str(CORES)], 2)
    return result


def disk_write_seconds(root: Path, nbytes: int) -> float:
    """Writing `nbytes` to one file and fsyncing it, 16 MiB at a time: the disk's own limit on a
    build that writes that much, whatever the number of workers."""
    block = np.random.default_rng(0).integers(0, 256, 16 * 2**20, dtype=np.uint8).tobytes()
    path = root / "disk-write.bin"
    os.sync()
    start = time.perf_counter()
    with path.open("wb") as out:
        for _ in range(max(1, nbytes // len(block))):
            out.write(block)
        out.flush()
        os.fsync(out.fileno())
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed


def _make_npy(folder: Path, rows: int) -> None:
    folder.mkdir()
    np.save(folder / "big.npy", np.random.default_rng(0).random((rows, 256), dtype=np.float32))


def _make_wav(folder: Path, seconds: int) -> None:
    """A 44.1 kHz recording (a tone plus noise), written a minute at a time."""
    import wave

    folder.mkdir()
    rate = 44_100
    rng = np.random.default_rng(0)
    with wave.open(str(folder / "long.wav"), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        for start in range(0, seconds, 60):
            t = np.arange(start * rate, min(seconds, start + 60) * rate) / rate
            wave_ = 0.3 * np.sin(2 * np.pi * 440 * t) + rng.normal(0, 0.05, t.size)
            out.writeframes(np.clip(wave_ * 32767, -32768, 32767).astype("<i2").tobytes())


def bench_big_npy(root: Path, rows: int, results: dict[str, Any]) -> None:
    args = ("--preprocess", "npy", "--split-rows", "--batch-size", "1024")
    results["big_npy"] = {"rows": rows, "row_bytes": 1024, **split_file_speedup(root, "npy", _make_npy, rows, args, 1)}


def bench_big_audio(root: Path, seconds: int, results: dict[str, Any]) -> None:
    """One long recording (resampled to 16 kHz: real work per sample), split into parts that
    workers take independently; the big .npy costs almost nothing to preprocess, so it measures
    the collator instead."""
    speedup = split_file_speedup(root, "wav", _make_wav, seconds, ("--preprocess", "audio"), 1)
    results["big_audio"] = {"seconds": seconds, **speedup}


SECTIONS = [
    "images",
    "order",
    "real_photos",
    "tiny",
    "startup",
    "incremental",
    "big_npy",
    "big_audio",
    "threads",
    "read",
    "read_once",
    "remote",
    "encoded",
    "scaling",
    "tables",
    "text",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--tiny", type=int, default=20000)
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--audio-seconds", type=int, default=3600)
    parser.add_argument("--manifest-rows", type=int, default=100_000)
    parser.add_argument("--documents", type=int, default=3000)
    parser.add_argument(
        "--only",
        choices=SECTIONS,
        action="append",
    )
    args = parser.parse_args()
    become_subreaper()
    results: dict[str, Any] = {
        "machine": f"{platform.processor() or platform.machine()}, {CORES} cores, Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
    }
    with tempfile.TemporaryDirectory(prefix="batchctl-bench-") as tmp:
        root = Path(tmp)
        todo = args.only or SECTIONS
        if "images" in todo:
            bench_images(root, args.images, results)
        if "order" in todo:
            from order import bench_order

            photos = root / "images"
            if not photos.exists():
                make_image_folder(photos, args.images, sides=(300, 900))
            command = lambda src, out, *extra: batchctl_cmd(src, out, CORES, *extra)  # noqa: E731
            bench_order(root, photos, args.images, results, command, run_measured)
        if "real_photos" in todo:
            from real_photos import bench_real_photos

            def litdata(src: Path, out: Path) -> tuple[float, float] | None:
                found = litdata_seconds(root, src, out)
                return None if found is None else found[:2]

            bench_real_photos(
                root,
                results,
                lambda src, out, *extra: batchctl_cmd(src, out, CORES, *extra),
                run_measured,
                CORES,
                litdata,
                lambda files: serial_rate(files, preprocess_image),
                serial_fraction,
            )
        if "tiny" in todo:
            bench_tiny(root, args.tiny, results)
        if "startup" in todo:
            bench_startup(root, results)
        if "incremental" in todo:
            bench_incremental(root, args.images, results)
        if "big_npy" in todo:
            bench_big_npy(root, args.rows, results)
        if "big_audio" in todo:
            bench_big_audio(root, args.audio_seconds, results)
        if "read" in todo:
            from read import bench_read

            bench_read(root, results, lambda src, out, *extra: batchctl_cmd(src, out, CORES, *extra))
        if "threads" in todo:
            from threads import bench_threads

            bench_threads(root, results)
        if "read_once" in todo:
            from read_once import bench_read_once

            bench_read_once(root, results, lambda src, out, *extra: batchctl_cmd(src, out, CORES, *extra))
        if "encoded" in todo:
            from encoded import bench_encoded

            bench_encoded(root, results, lambda src, out, *extra: batchctl_cmd(src, out, CORES, *extra))
        if "tables" in todo:
            from tables import bench_tables

            photos = root / "images"
            if not photos.exists():
                make_image_folder(photos, args.images, sides=(300, 900))

            def litdata_tables(src: Path, out: Path) -> tuple[float, float] | None:
                found = litdata_seconds(root, src, out)
                return None if found is None else found[:2]

            command = lambda src, out, *extra: batchctl_cmd(src, out, CORES, *extra)  # noqa: E731
            bench_tables(
                root, photos, args.images, args.manifest_rows, results, command, run_measured, litdata_tables, CORES
            )
        if "text" in todo:
            from text import bench_text

            command = lambda src, out, *extra: batchctl_cmd(src, out, CORES, *extra)  # noqa: E731
            bench_text(root, args.documents, results, command, run_measured, CORES)
        if "scaling" in todo:
            from scaling import bench_scaling

            bench_scaling(root, results)
        if "remote" in todo:
            from remote import bench_remote

            bench_remote(root, results, lambda src, out, *extra: batchctl_cmd(src, out, CORES, *extra))
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(results, indent=2))
    out_dir = HERE / "results"
    out_dir.mkdir(exist_ok=True)
    latest = out_dir / "latest.json"
    if args.only and latest.exists():  # a partial run updates its sections of the last full one
        results = {**json.loads(latest.read_text()), **results}
    latest.write_text(json.dumps(results, indent=2) + "\n")
    from report import check_goals, plot

    check_goals(results)
    plot(results, out_dir / "latest.png")


if __name__ == "__main__":
    main()
