"""Signal stress trials against the real CLI: random moments, every way a scheduler stops a job.

Each trial starts `batchctl build` in its own session with a unique tag in its environment, sends
one signal at a random moment (to the parent alone or to the whole process group), and records
what a user would see: the exit code, the seconds from the signal to the exit, a traceback (after
a SIGKILL, anything on stderr at all), the tagged processes still alive 3 s after the exit
(re-parented ones included: the tag travels in the environment, not in the process group), and
the /dev/shm names the build left.

`python -m tests.stress --trials 20 --kills 3` prints one line per trial and a summary; the suite
runs the same trials (`tests/test_lifecycle.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import BATCHCTL, ROOT

TAG = "BATCHCTL_STRESS_TAG"
GRACE_S = 3.0  # after the parent exits, its children have this long to be gone


@dataclass
class Trial:
    sig: str
    target: str  # "parent" or "group"
    delay: float  # seconds after the start that the signal was sent
    code: int | None = None
    exit_s: float | None = None  # from the signal to the parent's exit
    traceback: bool = False
    orphans: list[int] = field(default_factory=list)
    leaked: list[str] = field(default_factory=list)
    published: bool = False  # a complete dataset at OUTPUT: there after exit 0, never after 130/143
    stderr: str = ""

    @property
    def hung(self) -> bool:
        return self.code is None

    @property
    def noisy(self) -> bool:
        """Anything on stderr after a SIGKILL: the trials' builds run with -q, so it came from
        the build's other processes as they found their parent gone."""
        return self.sig == "SIGKILL" and self.stderr.strip() != ""

    def ok(self, expected: tuple[int, ...], run_s: float) -> bool:
        """As a user must see it; exit 0 (finished) only for a signal sent late enough to have
        met the publish (a full build takes `run_s`): earlier, a 0 would be a lost signal."""
        if self.code == 0 and self.delay < 0.5 * run_s and self.sig != "SIGKILL":
            return False
        clean = not (self.hung or self.traceback or self.noisy or self.orphans or self.leaked)
        honest = self.published if self.code == 0 else not (self.published and self.code in (130, 143))
        return clean and self.code in expected and honest

    def line(self) -> str:
        return (
            f"{self.sig:<7} {self.target:<6} at {self.delay:5.2f} s: exit {self.code}, "
            f"{'hung' if self.exit_s is None else f'{self.exit_s:.2f} s'}, "
            f"{len(self.orphans)} orphans, {len(self.leaked)} leaked names"
            f"{', TRACEBACK' if self.traceback else ''}{', NOISY' if self.noisy else ''}"
        )


def tagged_processes(tag: str) -> list[int]:
    """Live processes (zombies excluded) whose environment carries `tag`."""
    found = []
    needle = f"{TAG}={tag}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            found.append(int(entry.name))
    return found


def build_names(pid: int) -> list[str]:
    """/dev/shm names that a build whose parent is `pid` created (batchctl puts the pid in them)."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return []
    return sorted(p.name for p in shm.iterdir() if f"batchctl-{pid}-" in p.name)


def run_trial(
    args: list[str], output: Path, sig: signal.Signals, target: str, delay: float, timeout: float = 20
) -> Trial:
    """One build of `args` writing `output` (which must not exist yet), stopped by `sig`."""
    tag = uuid.uuid4().hex
    trial = Trial(sig.name, target, delay)
    proc = subprocess.Popen(
        [*BATCHCTL, *args, "-o", str(output)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
        env={**os.environ, TAG: tag},
    )
    time.sleep(delay)
    sent = time.monotonic()
    with contextlib.suppress(ProcessLookupError):
        if target == "group":
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
    try:
        _, trial.stderr = proc.communicate(timeout=timeout)
        trial.code = proc.returncode
        trial.exit_s = time.monotonic() - sent
    except subprocess.TimeoutExpired:
        pass
    exited = time.monotonic()
    while (left := tagged_processes(tag)) and time.monotonic() - exited < GRACE_S:
        time.sleep(0.05)
    trial.orphans = left
    trial.traceback = "Traceback" in trial.stderr
    if trial.hung or left:  # clean up after a failed trial, so the next one starts alike
        for pid in [proc.pid, *left]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.communicate()
    trial.leaked = build_names(proc.pid)
    trial.published = (output / "zarr.json").is_file()
    return trial


def plan(rng: random.Random, trials: int, kills: int, run_s: float) -> list[tuple[signal.Signals, str, float]]:
    """`trials` graceful signals, a third of them in the first second, the rest across the run and
    just past its usual end (the publish), then `kills` SIGKILLs of the parent alone."""
    moments = []
    for i in range(trials):
        sig = (signal.SIGINT, signal.SIGTERM)[i % 2]
        target = ("parent", "group")[(i // 2) % 2]
        delay = rng.uniform(0, 1) if i % 3 == 0 else rng.uniform(1, run_s * 1.1)
        moments.append((sig, target, delay))
    moments += [(signal.SIGKILL, "parent", rng.uniform(0.5, 0.7 * run_s)) for _ in range(kills)]
    return moments


def expected_codes(sig: signal.Signals) -> tuple[int, ...]:
    """130/143, or 0 when the signal came after the publish had begun (the build is complete then);
    -N when it came before the interpreter ran any of batchctl (a shell shows 128+N); SIGKILL: -9,
    or 0 if the build was already over."""
    if sig == signal.SIGKILL:
        return (-9, 0)
    return (128 + sig, 0, -sig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--seed", type=int, default=17)
    ns = parser.parse_args()
    from batchctl.synthetic import make_image_folder

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "photos"
        make_image_folder(src, ns.images, sides=(300, 600))
        common = [str(src), "--workers", "2", "--batch-size", "64", "-q"]
        started = time.monotonic()
        subprocess.run([*BATCHCTL, "build", *common, "-o", f"{tmp}/timing.zarr"], cwd=ROOT, check=True)
        run_s = time.monotonic() - started
        print(f"a full build takes {run_s:.2f} s")
        shm_before = set(os.listdir("/dev/shm"))
        results = []
        for n, (sig, target, delay) in enumerate(plan(random.Random(ns.seed), ns.trials, ns.kills, run_s)):
            trial = run_trial(["build", *common], Path(tmp) / f"out{n}.zarr", sig, target, delay)
            results.append((trial, trial.ok(expected_codes(sig), run_s)))
            print(("ok   " if results[-1][1] else "FAIL ") + trial.line(), flush=True)
        codes = sorted({str(t.code) for t, _ in results})
        print(
            f"{len(results)} trials: {sum(t.hung for t, _ in results)} hangs, "
            f"{sum(len(t.orphans) for t, _ in results)} orphans, "
            f"{sum(len(t.leaked) for t, _ in results)} leaked names, "
            f"{sum(t.traceback for t, _ in results)} tracebacks, {sum(not ok for _, ok in results)} failed; "
            f"exit codes seen: {', '.join(codes)}; slowest exit "
            f"{max((t.exit_s or 99) for t, _ in results):.2f} s"
        )
        added = set(os.listdir("/dev/shm")) - shm_before
        print(f"/dev/shm entries added machine-wide over all trials (any process's): {len(added)}")


if __name__ == "__main__":
    main()
