"""What placing rows in dispatch order costs: the photo build with the reorder window
against placing chunks as they arrive (what batchctl did before: `benchmarks/arrival/` on
PYTHONPATH patches the collator, no switch in batchctl), run alternately, side by side; then
the same with one deliberately slow file (1 s of sleep every 500th file, a plugin).
Whole-process rate and peak RSS of the process tree.

    python benchmarks/run.py --only order
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROUNDS = 4  # alternated; the median is kept (one run to the next varies by up to 10% on this shared machine)

SLOW_PLUGIN = '''
import time
from pathlib import Path

from batchctl.preprocess.image import preprocess_image


def slow_every(path: Path, every: int = 500, seconds: float = 1.0):
    """The image preprocessing; the files numbered every `every`-th (img00499, img00999, ...) sleep first."""
    number = int(path.stem[3:])
    if number % every == every - 1:
        time.sleep(seconds)
    return preprocess_image(path)
'''


def bench_order(
    root: Path,
    src: Path,
    count: int,
    results: dict[str, Any],
    command: Callable[..., list[str]],
    measure: Callable[..., tuple[float, int, Any]],
) -> None:
    plugin = root / "slow_plugin.py"
    plugin.write_text(SLOW_PLUGIN)
    slow = ["--preprocess", f"{plugin}:slow_every"]
    cases: dict[str, list[str]] = {"photos": [], "photos, 1 s sleep every 500th file": slow}
    table = []
    for case, extra in cases.items():
        runs: dict[str, list[tuple[float, int]]] = {"dispatch order": [], "arrival order": []}
        for _ in range(ROUNDS):
            for how in runs:
                env = {"PYTHONPATH": _with_arrival_patch()} if how == "arrival order" else {}
                out = root / "order.zarr"
                elapsed, peak, _ = measure(command(src, out, *extra), env=env)
                runs[how].append((count / elapsed, peak))
        row: dict[str, Any] = {"case": case}
        for how, found in runs.items():
            row[how] = {
                "samples_per_s": round(statistics.median(rate for rate, _ in found), 1),
                "peak_rss_mib": round(max(peak for _, peak in found) / 2**20, 1),
            }
        row["rate_ratio"] = round(row["dispatch order"]["samples_per_s"] / row["arrival order"]["samples_per_s"], 3)
        table.append(row)
    results["order"] = {"files": count, "rounds": ROUNDS, "rows": table, "window_mib": _window_mib()}


def _with_arrival_patch() -> str:
    """PYTHONPATH with `benchmarks/arrival` first (its sitecustomize patches the collator)."""
    return os.pathsep.join(filter(None, [str(HERE / "arrival"), os.environ.get("PYTHONPATH", "")]))


def _window_mib() -> float:
    from batchctl.run.reorder import WINDOW_BYTES

    return WINDOW_BYTES / 2**20
