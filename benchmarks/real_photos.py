"""The real photo set: 2,400 real photos (scikit-image's and scikit-learn's sample images,
scaled and cropped to 300-900 px, JPEG quality 80-95 with every 10th a PNG, 6 class folders),
and batchctl against the 50-line design and LitData on it, side by side, alternated; plus each
thread role's CPU per N files (from N to 4N files). Skipped where scikit-image or scikit-learn
is not installed (`pip install scikit-image scikit-learn`: bench only, never a test dependency).

    python benchmarks/run.py --only real_photos
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
COUNT = 2400
CLASSES = 6
ROUNDS = 4  # alternated: this shared machine's speed moves by 10-25% from one run to the next

FIFTY_TIMED = """
import sys, time
from pathlib import Path
sys.path.insert(0, {here!r})
import run

if __name__ == "__main__":  # the pool's forkserver imports this file again in each worker
    files = sorted(p for p in Path({src!r}).rglob('*') if p.is_file())
    started = time.perf_counter()  # the interpreter's start and imports left out, the pool's start in
    run.fifty_line_design(files, Path({out!r}), {workers})
    print("FIFTY_S", time.perf_counter() - started)
"""


def sample_photos() -> list[Any]:
    """The colour photos scikit-image and scikit-learn ship (no download), and their grey ones as RGB."""
    import skimage
    from PIL import Image
    from sklearn.datasets import load_sample_images

    folder = Path(skimage.__file__).parent / "data"
    names = [
        "astronaut.png", "chelsea.png", "coffee.png", "hubble_deep_field.jpg", "retina.jpg", "rocket.jpg",
        "motorcycle_left.png", "motorcycle_right.png", "ihc.png", "camera.png", "moon.png", "coins.png",
        "brick.png", "grass.png", "gravel.png",
    ]  # fmt: skip
    images = [Image.open(folder / name).convert("RGB") for name in names if (folder / name).exists()]
    images += [Image.fromarray(array) for array in load_sample_images().images]
    return images


def make_real_photos(folder: Path, count: int = COUNT, seed: int = 0) -> list[Path]:

    rng = np.random.default_rng(seed)
    sources = sample_photos()
    paths = []
    for i in range(count):
        source = sources[i % len(sources)]
        width, height = (int(v) for v in rng.integers(300, 901, 2))
        scale = max(width / source.width, height / source.height) * float(rng.uniform(1.0, 1.5))
        box_w, box_h = min(source.width, width / scale), min(source.height, height / scale)  # in the source
        left = float(rng.uniform(0, source.width - box_w))
        top = float(rng.uniform(0, source.height - box_h))
        crop = source.resize((width, height), box=(left, top, left + box_w, top + box_h))  # scaled and cropped
        target = folder / f"class{i % CLASSES}"
        target.mkdir(parents=True, exist_ok=True)
        if i % 10 == 9:
            path = target / f"photo{i:05d}.png"
            crop.save(path)
        else:
            path = target / f"photo{i:05d}.jpg"
            crop.save(path, quality=int(rng.integers(80, 96)))
        paths.append(path)
    return paths


def bench_real_photos(
    root: Path,
    results: dict[str, Any],
    command: Callable[..., list[str]],
    measure: Callable[..., tuple[float, int, Any]],
    workers: int,
    litdata: Callable[[Path, Path], tuple[float, float] | None],
    serial_rate: Callable[[list[Path]], float],
    stage_cpu: Callable[[dict[Any, Any], dict[Any, Any], int], dict[str, Any]],
) -> None:
    try:
        import skimage  # noqa: F401
        import sklearn  # noqa: F401
    except ImportError:
        print("[info] scikit-image or scikit-learn is not installed: the real-photo rows are left out")
        return
    src = root / "real_photos"
    files = make_real_photos(src)
    r = serial_rate(files[:400])
    rates: dict[str, list[float]] = {"batchctl build (whole process)": [], "the 50-line design (pool start in)": []}
    peaks: list[int] = []
    job = root / "fifty_timed.py"
    job.write_text(FIFTY_TIMED.format(here=str(HERE), src=str(src), out=str(root / "fifty_real"), workers=workers))
    for _ in range(ROUNDS):  # each run writes into an empty folder: neither deletes the last one's output
        shutil.rmtree(root / "real.zarr", ignore_errors=True)
        elapsed, peak, _ = measure(command(src, root / "real.zarr"))
        rates["batchctl build (whole process)"].append(len(files) / elapsed)
        peaks.append(peak)
        shutil.rmtree(root / "fifty_real", ignore_errors=True)
        _, _, proc = measure([sys.executable, str(job)])
        fifty_s = float(next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("FIFTY_S")))
        rates["the 50-line design (pool start in)"].append(len(files) / fifty_s)
    rows = [{"tool": "serial loop", "workers": 1, "samples_per_s": round(r, 1)}]
    for tool, found in rates.items():
        rows.append({"tool": tool, "workers": workers, "samples_per_s": round(statistics.median(found), 1)})
    found_litdata = litdata(src, root / "litdata_real")
    if found_litdata is not None:
        whole, call = found_litdata
        rows.append(
            {
                "tool": "LitData optimize() (whole process)",
                "workers": workers,
                "samples_per_s": round(len(files) / whole, 1),
            }
        )
        rows.append(
            {
                "tool": "LitData optimize() (the call alone)",
                "workers": workers,
                "samples_per_s": round(len(files) / call, 1),
            }
        )
    quarter = root / "real_quarter"
    for path in files[: len(files) // 4]:
        target = quarter / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.link(path, target)
    threads_n: dict[Any, Any] = {}
    threads_4n: dict[Any, Any] = {}
    stages_n = measure_stages(command, measure, quarter, root / "real_n.zarr", threads_n)
    stages_4n = measure_stages(command, measure, src, root / "real_4n.zarr", threads_4n)
    results["real_photos"] = {
        "files": len(files),
        "bytes": sum(path.stat().st_size for path in files),
        "serial_rate": round(r, 1),
        "rounds": ROUNDS,
        "rows": rows,
        "peak_rss_mib": round(max(peaks) / 2**20, 1),
        "stages": {"files_n": len(files) // 4, **stage_cpu(threads_n, threads_4n, 3)},
        "stage_seconds": {"n": stages_n, "4n": stages_4n},
        "measured": time.strftime("%Y-%m-%d"),
    }


def measure_stages(
    command: Callable[..., list[str]],
    measure: Callable[..., tuple[float, int, Any]],
    src: Path,
    out: Path,
    threads: dict[Any, Any],
) -> dict[str, Any]:
    """One build's wall time by stage (the report's `timings`; `process_s` is what the report
    does not see: the interpreter's start, the imports and the exit) and the CPU seconds of each
    thread role summed over its threads (workers, the collator's main thread, its writer and hash
    threads, the parent)."""
    report = out.with_suffix(".report.json")
    shutil.rmtree(out, ignore_errors=True)
    elapsed, peak, _ = measure(command(src, out, "--report", str(report)), threads)
    found = json.loads(report.read_text())
    cpu: dict[str, float] = {}
    for role, seconds in threads.values():
        process, thread = role.split("/", 1)  # (a process's name is cut to 15 characters)
        if process == "batchctl-collat":
            name = "collator main thread" if thread == "main" else "collator writer and hash threads"
        else:
            name = {"batchctl-worker": "workers", "parent": "parent"}.get(process, "fork server, resource tracker")
        cpu[name] = cpu.get(name, 0.0) + seconds
    return {
        "elapsed_s": round(elapsed, 3),
        "process_s": round(elapsed - found["elapsed_s"], 3),
        **found["timings"],
        "peak_rss_mib": round(peak / 2**20, 1),
        "cpu_s": {name: round(seconds, 3) for name, seconds in sorted(cpu.items())},
    }
