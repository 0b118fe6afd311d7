"""Work lost per graceful interrupt: a build of generated photos (2 workers, batch 64) is stopped
with SIGINT at a random moment and rerun until it completes; the files preprocessed over all runs,
less the number of files, are the files preprocessed again.

    python benchmarks/interrupts.py [--images 900] [--seed 5]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from batchctl.synthetic import make_image_folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=900)
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--max-runs", type=int, default=20)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        src, out, report = Path(tmp) / "photos", Path(tmp) / "out.zarr", Path(tmp) / "report.json"
        make_image_folder(src, args.images, sides=(300, 900))
        cmd = [sys.executable, "-m", "batchctl", "build", str(src), "-o", str(out), "--workers", "2"]
        cmd += ["--batch-size", "64", "-q", "--report", str(report)]
        processed = interrupts = 0
        for _ in range(args.max_runs):
            proc = subprocess.Popen(cmd, start_new_session=True)
            time.sleep(rng.uniform(1.2, 2.2))
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait()
            data = json.loads(report.read_text())
            processed += data["processed"]
            if data["status"] == "complete":
                break
            interrupts += 1
        done = "complete" if json.loads(report.read_text())["status"] == "complete" else "not complete"
        print(
            f"{interrupts} interrupts, {processed} files preprocessed for {args.images} "
            f"({processed - args.images} done again), {done}"
        )


if __name__ == "__main__":
    main()
