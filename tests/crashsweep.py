"""Kill a build at one exact system call, then check what the next runs make of what it left.

strace's fault injection (`-e inject=CALL:signal=SIGKILL:when=N`) SIGKILLs the build's parent
process as it makes its N-th call of a set (renames, unlinks, links, truncates, fsyncs, mkdirs);
the kernel then kills its collator and workers (PR_SET_PDEATHSIG). Each trial starts from the
same state (`prepare`: an incremental build, a fresh one, or the resume of an interrupted one),
runs the killed build, reruns twice, then adds files and builds once more; after every run that exits 0 the dataset must
pass `verify` and hold every file of the folder exactly once, with its contents.

`python -m tests.crashsweep` sweeps every call of each set and prints one line per trial; the
suite (`tests/test_crash_consistency.py`) runs every rename-family call and a sample of the others.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import batchctl
from batchctl.errors import BatchctlError
from batchctl.read.inspect import verify
from tests.conftest import BATCHCTL, ROOT

CALL_SETS = {  # strace counts each system call apart (`when=N` is the N-th call of that one): swept one by one
    "rename": ("rename", "renameat", "renameat2"),
    "unlink": ("unlink", "unlinkat", "rmdir"),
    "link": ("link", "linkat", "symlink", "symlinkat"),
    "truncate": ("truncate", "ftruncate"),
    "fsync": ("fsync", "fdatasync"),
    "mkdir": ("mkdir", "mkdirat"),
}
OPTIONS = ["--preprocess", "npy", "--batch-size", "2", "--shard-batches", "2", "--workers", "1", "-q"]


@dataclass
class Outcome:
    calls: str
    when: int
    scenario: str = "incremental"
    killed: bool = False  # the injected kill happened (else the run had fewer such calls)
    problems: list[str] = field(default_factory=list)

    def line(self) -> str:
        state = "killed" if self.killed else "not reached"
        return f"{self.scenario:11} {self.calls:9} #{self.when:<3} {state:11} " + (
            "ok" if not self.problems else "; ".join(self.problems)
        )


class Workspace:
    """A folder of small .npy files in two class folders and its complete dataset, put back the
    same (paths and mtimes) before each trial, so the dataset's record stays valid for it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data, self.out = root / "data", root / "out.zarr"
        self.pristine = root / "pristine"
        self.counter = 0

    def create(self, files: int = 30) -> None:
        for i in range(files):
            self.write(f"{'ab'[i % 2]}/f{i:02d}.npy", i)
        self.run_build(check=True)
        self.pristine.mkdir()
        for name in self.keep:
            self._copy(self.root / name, self.pristine / name)

    @property
    def keep(self) -> list[str]:
        return ["data", "out.zarr"]  # the dataset's record is inside it

    def restore(self) -> None:
        for name in [*self.keep, ".out.zarr.batchctl", ".out.zarr.batchctl.lock"]:
            path = self.root / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        for name in self.keep:
            self._copy(self.pristine / name, self.root / name)

    @staticmethod
    def _copy(src: Path, dst: Path) -> None:
        if src.is_dir():
            shutil.copytree(src, dst, copy_function=shutil.copy2)
        else:
            shutil.copy2(src, dst)

    def write(self, relpath: str, value: int) -> None:
        path = self.data / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, np.full(3, value, dtype=np.int64) + np.arange(3))

    def change(self, round_: int, grow_only: bool = False) -> None:
        """Add two files; unless `grow_only`, rewrite one (other contents, a later mtime) and
        remove one."""
        self.counter += 1
        value = 1000 * round_ + self.counter
        self.write(f"a/new{round_}-{self.counter}.npy", value)
        self.write(f"b/new{round_}-{self.counter}.npy", value + 1)
        if grow_only:
            return
        changed = sorted(self.data.rglob("*.npy"))[round_ % 3]
        np.save(changed, np.full(3, value, dtype=np.int64))
        stamp = changed.stat().st_mtime_ns + 10**9
        os.utime(changed, ns=(stamp, stamp))
        removed = sorted(self.data.rglob("*.npy"))[-1 - round_ % 2]
        removed.unlink()

    def run_build(self, *prefix: str, check: bool = False) -> subprocess.CompletedProcess[str]:
        command = [*prefix, *BATCHCTL, "build", str(self.data), "-o", str(self.out), *OPTIONS]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
        if check and result.returncode != 0:
            raise AssertionError(result.stderr)
        return result

    def problems(self) -> list[str]:
        """What is wrong with the dataset at OUTPUT against the folder as it is now."""
        found = [f"verify: {p}" for p in verify(self.out)]
        want = {p.relative_to(self.data).as_posix(): np.load(p) for p in self.data.rglob("*.npy")}
        seen: dict[str, int] = {}
        try:
            for batch in batchctl.open(self.out):
                for source, index, array in zip(batch["source"], batch["source_index"], batch["array"], strict=True):
                    seen[str(source)] = seen.get(str(source), 0) + 1
                    if int(index) != 0 or str(source) not in want or not np.array_equal(array, want[str(source)]):
                        found.append(f"row of {source} ({index}) is not that file's")
        except BatchctlError as exc:
            return [*found, f"reading: {exc}"]
        if set(seen) != set(want) or any(count != 1 for count in seen.values()):
            missing, extra = sorted(set(want) - set(seen)), sorted(set(seen) - set(want))
            twice = sorted(s for s, count in seen.items() if count > 1)
            found.append(f"sources: missing {missing}, extra {extra}, twice {twice}")
        return found


SCENARIOS = ("incremental", "fresh", "resume")


def prepare(space: Workspace, scenario: str) -> None:
    """The state the killed run starts from: the complete dataset and a changed folder
    (`incremental`), no dataset yet (`fresh`), or a fresh build whose collator was killed at its
    twelfth fsync, leaving a journal of some shards to resume from (`resume`)."""
    space.restore()
    space.change(1)
    if scenario in ("fresh", "resume"):
        shutil.rmtree(space.out)
    if scenario == "resume":  # of a fresh build, whose parent makes no fsync: the collator's are its own
        kill_collator = ["strace", "-f", "-qq", "-o", os.devnull, "-e", "trace=fsync"]
        stopped = space.run_build(*kill_collator, "-e", "inject=fsync:signal=SIGKILL:when=12")
        if stopped.returncode != 1 or "rerun" not in stopped.stderr:
            raise AssertionError(f"the collator was not stopped: {stopped.returncode} {stopped.stderr}")


def trial(space: Workspace, calls: str, when: int, scenario: str = "incremental", follow: bool = False) -> Outcome:
    """One kill at the `when`-th call of the system call `calls` of a build (see `prepare`), and
    what follows. `follow`: of any of its processes (the collator's journal and shard writes
    too): the first to make its `when`-th such call is killed."""
    outcome = Outcome(calls, when, scenario)
    prepare(space, scenario)
    inject = calls
    strace = [
        "strace",
        *(["-f"] if follow else []),
        "-qq",
        "-o",
        os.devnull,
        "-e",
        f"trace={inject}",
        "-e",
        f"inject={inject}:signal=SIGKILL:when={when}",
    ]
    killed = space.run_build(*strace)
    # the parent killed: -9; a child killed: the parent fails in one line (exit 1), naming the rerun
    outcome.killed = killed.returncode == -9 or (follow and killed.returncode != 0)
    if follow and killed.returncode not in (-9, 0) and ("Traceback" in killed.stderr or killed.returncode != 1):
        outcome.problems.append(f"the killed run exit {killed.returncode}: {killed.stderr.strip()[-300:]}")
        return outcome
    runs = [("the killed run", killed)] if not outcome.killed else []
    runs += [("rerun 1", space.run_build()), ("rerun 2", space.run_build())]
    for name, result in runs:
        if result.returncode != 0 or "Traceback" in result.stderr:
            outcome.problems.append(f"{name} exit {result.returncode}: {result.stderr.strip()[-300:]}")
            return outcome
        outcome.problems += [f"after {name}: {p}" for p in space.problems()]
        if outcome.problems:
            return outcome
    space.change(2, grow_only=True)  # a folder that only grows: the nightly case
    after = space.run_build()
    if after.returncode != 0:
        outcome.problems.append(f"the next change's run exit {after.returncode}: {after.stderr.strip()[-300:]}")
        return outcome
    outcome.problems += [f"after the next change: {p}" for p in space.problems()]
    return outcome


def count_calls(space: Workspace, calls: tuple[str, ...], scenario: str = "incremental") -> dict[str, int]:
    """How many of each system call the build's process makes in `scenario` (strace -c)."""
    prepare(space, scenario)
    log = space.root / "count.txt"
    result = space.run_build("strace", "-qq", "-c", "-o", str(log), "-e", f"trace={','.join(calls)}")
    if result.returncode != 0:
        raise AssertionError(result.stderr)
    counted = {}
    for line in log.read_text().splitlines():
        fields = line.split()
        if fields and fields[-1] in calls:
            counted[fields[-1]] = int(fields[3])
    return counted


def sweep(
    space: Workspace,
    calls: str,
    whens: list[int] | None = None,
    scenario: str = "incremental",
    limit: int = 400,
    follow: bool = False,
) -> list[Outcome]:
    """Trials at the `whens`-th calls of the system call `calls` (default: 1, 2, ... until a
    run makes fewer of them)."""
    outcomes = []
    for when in whens or range(1, limit + 1):
        outcome = trial(space, calls, when, scenario, follow)
        outcomes.append(outcome)
        if not outcome.killed and whens is None:
            break
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", nargs="*", default=list(CALL_SETS), choices=list(CALL_SETS))
    parser.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--follow", action="store_true", help="kill whichever of the build's processes gets there")
    parser.add_argument("--dir", type=Path, default=None, help="a scratch folder (default: a new temporary one)")
    args = parser.parse_args()
    root = args.dir or Path(os.environ.get("TMPDIR", "/tmp")) / f"crashsweep-{os.getpid()}"
    root.mkdir(parents=True, exist_ok=True)
    space = Workspace(root)
    space.create()
    started, bad, total = time.monotonic(), 0, 0
    for scenario in args.scenarios:
        made = count_calls(space, tuple(name for group in args.calls for name in CALL_SETS[group]), scenario)
        for calls in sorted(made):
            for outcome in sweep(space, calls, scenario=scenario, follow=args.follow):
                print(outcome.line(), flush=True)
                total += outcome.killed
                bad += bool(outcome.problems)
    print(f"{total} kills, {bad} trials with problems, {time.monotonic() - started:.0f} s")
    shutil.rmtree(root, ignore_errors=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
