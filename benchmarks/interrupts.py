"""Work lost per interrupt: a build of generated photos (2 workers, batch 64) is stopped with
SIGINT (graceful) or SIGKILL of its whole process group (`kill -9`: nothing runs on) at a random
moment, and rerun until it completes; the files preprocessed over all runs (each call is logged
by benchmarks/counting.py), less the number of files, are the files preprocessed again.

    python benchmarks/interrupts.py [--images 900] [--seed 5] [--signal INT|KILL]
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
    parser.add_argument("--signal", choices=["INT", "KILL"], default="INT")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    sig = signal.Signals[f"SIG{args.signal}"]
    with tempfile.TemporaryDirectory() as tmp:
        src, out, report = Path(tmp) / "photos", Path(tmp) / "out.zarr", Path(tmp) / "report.json"
        count = Path(tmp) / "preprocessed.txt"
        make_image_folder(src, args.images, sides=(300, 900))
        cmd = [sys.executable, "-m", "batchctl", "build", str(src), "-o", str(out), "--workers", "2"]
        cmd += ["--batch-size", "64", "-q", "--report", str(report)]
        cmd += ["--preprocess", f"{Path(__file__).parent / 'counting.py'}:counted_image"]
        env = {**os.environ, "BATCHCTL_BENCH_COUNT": str(count)}
        interrupts = 0
        for _ in range(args.max_runs):
            report.unlink(missing_ok=True)
            proc = subprocess.Popen(cmd, start_new_session=True, env=env)
            time.sleep(rng.uniform(1.2, 2.2))
            os.killpg(proc.pid, sig)
            proc.wait()
            if report.exists() and json.loads(report.read_text())["status"] == "complete":
                break
            interrupts += 1
        processed = len(count.read_text().splitlines())
        complete = report.exists() and json.loads(report.read_text())["status"] == "complete"
        print(
            f"SIG{args.signal}: {interrupts} interrupts, {processed} files preprocessed for {args.images} "
            f"({processed - args.images} done again, {(processed - args.images) / max(interrupts, 1):.0f} "
            f"per interrupt), {'complete' if complete else 'not complete'}"
        )


if __name__ == "__main__":
    main()
