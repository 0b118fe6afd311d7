"""The scaling table: the README's command (`batchctl build PHOTOS --workers W`, default
options) at W = 1, 4, 8, 16 (those this machine's cores allow, and all of them), each on a photo
set sized for about `seconds` of work at W x the serial rate, with every thread's CPU (the
per-thread table: each role's busiest thread over the mean worker's, and all of them together). The goal: the rate at 16
workers >= 0.85 x 16 x the rate at 1.

    python run.py --only scaling                   # inside `make bench`'s harness
    python scaling.py [SECONDS]                    # alone: prints the table as JSON

Made to run in one call on a lent 16-core machine (docs/performance.md names the machine of
each figure): ~1,000 photos are made once and hard-linked to each size (a link costs no disk),
each output is removed before the next run (16 workers x 30 s of photos is ~40 GB of pixels)."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from batchctl.synthetic import make_image_folder

WORKERS = (1, 4, 8, 16)
BASE_PHOTOS = 1000


def worker_counts(cores: int) -> list[int]:
    """The counts of the table this machine can run side by side with a core each, and all its cores."""
    return sorted({w for w in WORKERS if w <= cores} | {cores})


def bench_scaling(root: Path, results: dict[str, Any], seconds: float = 30.0) -> None:
    from run import CORES, batchctl_cmd, linked_copies, role_cpu, run_measured, serial_rate

    from batchctl.preprocess.image import preprocess_image

    base = root / "scaling-photos"
    make_image_folder(base, BASE_PHOTOS, sides=(300, 700))
    files = sorted(p for p in base.rglob("*") if p.is_file())
    r = serial_rate(files[:200], preprocess_image)
    rows: list[dict[str, Any]] = []
    for workers in worker_counts(CORES):
        times = max(1, math.ceil(workers * r * seconds / BASE_PHOTOS))
        photos, out = root / f"scaling-{workers}", root / f"scaling-{workers}.zarr"
        linked_copies(base, photos, times)
        threads: Any = {}
        elapsed, peak, _ = run_measured(batchctl_cmd(photos, out, workers), threads)
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(photos, ignore_errors=True)
        roles = role_cpu(threads)
        worker = roles.pop("batchctl-worker/main", 0.0)
        beside = sum(cpu for role, cpu in threads.values() if role != "batchctl-worker/main")
        busiest = max(roles, key=lambda role: roles[role], default="")
        rows.append(
            {
                "workers": workers,
                "files": times * BASE_PHOTOS,
                "seconds": round(elapsed, 2),
                "files_per_s": round(times * BASE_PHOTOS / elapsed, 1),
                "peak_rss_mib": round(peak / 2**20),
                "busiest_other_thread": busiest,
                "its_cpu_over_a_workers": round(roles.get(busiest, 0.0) / worker, 4) if worker else None,
                "all_beside_workers_over_a_workers": round(beside / worker, 4) if worker else None,
                "roles_cpu_over_a_workers": {
                    role: round(cpu / worker, 4) for role, cpu in sorted(roles.items()) if worker
                },
            }
        )
    one = rows[0]["files_per_s"]
    for row in rows:
        row["vs_workers_x_rate_at_1"] = round(row["files_per_s"] / (row["workers"] * one), 3)
    results["scaling"] = {"cores": CORES, "serial_files_per_s": round(r, 1), "seconds_asked": seconds, "rows": rows}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    found: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="batchctl-scaling-", dir=os.environ.get("BATCHCTL_BENCH_DIR")) as tmp:
        bench_scaling(Path(tmp), found, float(sys.argv[1]) if len(sys.argv) > 1 else 30.0)
    print(json.dumps(found, indent=2))
