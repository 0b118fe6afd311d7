"""Crash consistency of the publish: a build SIGKILLed at one exact system call (strace's fault
injection), then rerun twice and grown once more, never leaves a wrong dataset behind an exit 0.
Each trial's checks are in `tests/crashsweep.py` (`python -m tests.crashsweep` sweeps every call)."""

from __future__ import annotations

import shutil

import pytest

from . import crashsweep
from .conftest import LONG, sweep_rng

pytestmark = pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace (fault injection)")


@pytest.fixture(scope="module")
def space(tmp_path_factory: pytest.TempPathFactory) -> crashsweep.Workspace:
    made = crashsweep.Workspace(tmp_path_factory.mktemp("crash"))
    made.create()
    return made


@pytest.mark.parametrize("scenario", crashsweep.SCENARIOS)
def test_a_kill_at_every_rename_leaves_a_right_dataset(space: crashsweep.Workspace, scenario: str) -> None:
    """Rename-family calls: the first, the last two (the publish) and two drawn anew each run;
    every one of an incremental build's in make test-long (that sweep found a kill after the
    exchange resuming from the previous dataset, before the publish marker), and `python -m
    tests.crashsweep` tries them all in every scenario (README, Crash consistency)."""
    made = crashsweep.count_calls(space, crashsweep.CALL_SETS["rename"], scenario)
    if scenario == "incremental":
        assert made.get("renameat2") == 1  # the exchange with the previous dataset
    rng = sweep_rng(f"renames of a {scenario} build")
    outcomes = []
    for calls, total in sorted(made.items()):
        moments = list(range(1, total + 1))
        if not (LONG and scenario == "incremental"):
            moments = sorted({1, max(1, total - 1), total, rng.randint(1, total), rng.randint(1, total)})
        outcomes += crashsweep.sweep(space, calls, moments, scenario=scenario)
    assert all(outcome.killed for outcome in outcomes)  # each moment counted was reached
    assert [outcome.line() for outcome in outcomes if outcome.problems] == []


@pytest.mark.parametrize("group", ["unlink", "fsync", "truncate", "mkdir", "link"])
def test_a_kill_at_other_calls_that_change_files_leaves_a_right_dataset(
    space: crashsweep.Workspace, group: str
) -> None:
    """A sample of each call's moments in an incremental build: its last and one drawn anew each
    run (`python -m tests.crashsweep` tries them all, in all three scenarios)."""
    made = crashsweep.count_calls(space, crashsweep.CALL_SETS[group])
    rng = sweep_rng(f"{group} calls")
    for calls, total in sorted(made.items()):
        outcomes = crashsweep.sweep(space, calls, sorted({total, rng.randint(1, total)}))
        assert all(outcome.killed for outcome in outcomes), [outcome.line() for outcome in outcomes]
        assert [outcome.line() for outcome in outcomes if outcome.problems] == []
