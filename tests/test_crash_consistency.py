"""Crash consistency of the publish: a build SIGKILLed at one exact system call (strace's fault
injection), then rerun twice and grown once more, never leaves a wrong dataset behind an exit 0.
Each trial's checks are in `tests/crashsweep.py` (`python -m tests.crashsweep` sweeps every call)."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from . import crashsweep

pytestmark = pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace (fault injection)")


@pytest.fixture(scope="module")
def space(tmp_path_factory: pytest.TempPathFactory) -> crashsweep.Workspace:
    made = crashsweep.Workspace(tmp_path_factory.mktemp("crash"))
    made.create()
    return made


def test_a_kill_at_every_rename_of_an_incremental_run_leaves_a_right_dataset(space: crashsweep.Workspace) -> None:
    outcomes = crashsweep.sweep(space, "rename")
    assert sum(outcome.killed for outcome in outcomes) >= 8  # the staging's documents, the state, the publish
    assert [outcome.line() for outcome in outcomes if outcome.problems] == []


@pytest.mark.parametrize("calls", ["unlink", "fsync", "truncate", "mkdir", "link"])
def test_a_kill_at_other_calls_that_change_files_leaves_a_right_dataset(
    space: crashsweep.Workspace, calls: str
) -> None:
    """A sample of each set's calls (the first, the last and two between, drawn anew each run;
    `python -m tests.crashsweep` tries them all)."""
    total = count_calls(space, calls)
    whens = sorted({1, total, *random.sample(range(1, total + 1), min(2, total))}) if total else []
    outcomes = crashsweep.sweep(space, calls, whens)
    assert all(outcome.killed for outcome in outcomes)
    assert [outcome.line() for outcome in outcomes if outcome.problems] == []


def count_calls(space: crashsweep.Workspace, calls: str) -> int:
    """How many calls of the set the parent of an incremental run makes (strace -c)."""
    space.restore()
    space.change(1)
    log = space.root / "count.txt"
    result = space.run_build("strace", "-qq", "-c", "-o", str(log), "-e", f"trace={crashsweep.CALL_SETS[calls]}")
    assert result.returncode == 0, result.stderr
    total = 0
    for line in Path(log).read_text().splitlines():
        fields = line.split()
        if fields and fields[-1] in crashsweep.CALL_SETS[calls].split(","):
            total += int(fields[3])
    return total
