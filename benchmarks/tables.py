"""Building from tables: the same photos as a folder, as a CSV of their paths, as a Parquet of
their bytes (the Hugging Face hub's `image: {bytes, path}`) and as a Python list of their paths
(`batchctl.build(paths, ...)`), alternated rounds, medians, each build whole (`--force`);
LitData's `optimize(fn, inputs)` over the same list of files; and a manifest of many tiny .npy
files named by a CSV, against the same files as a folder: planning (start to the first task
dispatched, the report's `start_s`) and peak RSS of the process tree.

    python benchmarks/run.py --only tables [--images N] [--manifest-rows N]
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

PYTHON_JOB = """
import json, sys
import batchctl

if __name__ == "__main__":
    paths, out, workers = json.load(open(sys.argv[1])), sys.argv[2], int(sys.argv[3])
    batchctl.build(paths, out, preprocess="image", workers=workers, force=True, quiet=True)
"""
ROUNDS = 3  # alternated; the median is kept (one run to the next varies by a tenth on this shared machine)


def _photo_tables(src: Path, folder: Path) -> tuple[Path, Path]:
    """A CSV naming the photos (in SRC's parent, beside SRC: nothing is added to SRC, which
    LitData's job walks) and a Parquet holding them (in `folder`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file())
    csv = src.parent / "train.csv"
    csv.write_text("file_name,kind\n" + "".join(f"{src.name}/{p},{p.split('/')[0]}\n" for p in paths))
    folder.mkdir(parents=True, exist_ok=True)
    parquet = folder / "train.parquet"
    images = [{"bytes": (src / p).read_bytes(), "path": p.rsplit("/", 1)[-1]} for p in paths]
    pq.write_table(pa.table({"image": images, "kind": [p.split("/")[0] for p in paths]}), parquet, row_group_size=100)
    return csv, parquet


def bench_tables(
    root: Path,
    src: Path,
    count: int,
    manifest_rows: int,
    results: dict[str, Any],
    command: Callable[..., list[str]],
    measure: Callable[..., tuple[float, int, Any]],
    litdata: Callable[[Path, Path], tuple[float, float] | None],
    workers: int,
) -> None:
    csv, parquet = _photo_tables(src, root / "hub")
    listed, job = root / "paths.json", root / "python_job.py"
    listed.write_text(json.dumps(sorted(str(p) for p in src.rglob("*") if p.is_file())))
    job.write_text(PYTHON_JOB)
    out = root / "tables.zarr"
    forms = {
        "folder (class folders)": command(src, out),
        "CSV of paths (--label kind)": command(csv, out, "--label", "kind"),
        "Parquet of the photos' bytes (--label kind)": command(parquet, out, "--label", "kind"),
        "Python list of the paths (batchctl.build(paths, ...))": [
            sys.executable,
            str(job),
            str(listed),
            str(out),
            str(workers),
        ],
    }
    runs: dict[str, list[tuple[float, int]]] = {form: [] for form in forms}
    for _ in range(ROUNDS):
        for form, cmd in forms.items():
            shutil.rmtree(out, ignore_errors=True)
            elapsed, peak, _ = measure(cmd)
            runs[form].append((count / elapsed, peak))
    folder_rate = statistics.median(rate for rate, _ in runs["folder (class folders)"])
    rows = []
    for form, found in runs.items():
        rate = statistics.median(r for r, _ in found)
        rows.append(
            {
                "source": form,
                "samples_per_s": round(rate, 1),
                "of_folder": round(rate / folder_rate, 3),
                "peak_rss_mib": round(max(p for _, p in found) / 2**20, 1),
            }
        )
    section: dict[str, Any] = {"photos": count, "rounds": ROUNDS, "rows": rows}
    peer = litdata(src, root / "litdata_tables")
    if peer is not None:
        table_rate = next(r["samples_per_s"] for r in rows if r["source"].startswith("CSV"))
        list_rate = next(r["samples_per_s"] for r in rows if r["source"].startswith("Python"))
        section["litdata"] = {
            "samples_per_s": round(count / peer[0], 1),
            "csv_build_over_litdata": round(table_rate / (count / peer[0]), 2),
            "python_list_over_litdata": round(list_rate / (count / peer[0]), 2),
        }
    section["manifest"] = _manifest(root, manifest_rows, command, measure)
    results["tables"] = section


def _manifest(
    root: Path, rows: int, command: Callable[..., list[str]], measure: Callable[..., tuple[float, int, Any]]
) -> dict[str, Any]:
    """`rows` tiny .npy files, as a flat folder and as a CSV naming each with a score and a class."""
    folder = root / "manifest"
    folder.mkdir()
    template = root / "one.npy"
    np.save(template, np.arange(4, dtype=np.float32))
    lines = ["file_name,kind,score"]
    for i in range(rows):
        (folder / f"{i:07d}.npy").write_bytes(template.read_bytes())
        lines.append(f"manifest/{i:07d}.npy,{'abc'[i % 3]},{i / 7:.3f}")
    (root / "manifest.csv").write_text("\n".join(lines) + "\n")
    found: dict[str, Any] = {"rows": rows}
    npy = ["--preprocess", "npy", "--batch-size", "256"]
    for name, source, extra in (
        ("folder", folder, []),
        ("csv", root / "manifest.csv", ["--label", "kind"]),
    ):
        report = root / f"manifest-{name}.json"
        out = root / f"manifest-{name}.zarr"
        elapsed, peak, _ = measure(command(source, out, *npy, *extra, "--report", str(report)))
        timings = json.loads(report.read_text())["timings"]
        found[name] = {
            "seconds": round(elapsed, 2),
            "planning_s": timings.get("start_s"),
            "peak_rss_mib": round(peak / 2**20, 1),
        }
    return found
