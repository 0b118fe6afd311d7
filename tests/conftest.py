"""Shared fixtures: generated input folders, the real CLI in a subprocess, leftover-process checks."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from batchctl.synthetic import make_image_folder

ROOT = Path(__file__).resolve().parent.parent
BATCHCTL = [sys.executable, "-m", "batchctl"]
PLUGINS = str(ROOT / "tests" / "plugins.py")

# The fault sweeps (random signal moments, kill points): `make test` samples a few moments of
# each, drawn anew every run from one seed it prints at the end (BATCHCTL_TEST_SEED=N repeats a
# run's draws); `make test-long` (BATCHCTL_TEST_LONG=1) runs every sweep in full.
LONG = os.environ.get("BATCHCTL_TEST_LONG", "") not in ("", "0")
SWEEP_SEED = int(os.environ.get("BATCHCTL_TEST_SEED") or random.SystemRandom().randrange(2**31))


def sweep_rng(name: str) -> random.Random:
    """One sweep's random moments: this run's seed and the sweep's name (so that each sweep's
    draws do not depend on which other tests ran)."""
    return random.Random(f"{SWEEP_SEED}:{name}")


def sweep(short: int, long: int) -> int:
    """How many moments a sweep tries: `short` in `make test`, `long` in `make test-long`."""
    return long if LONG else short


def pytest_terminal_summary(terminalreporter: Any) -> None:
    mode = "in full (make test-long)" if LONG else "sampled (make test-long runs them in full)"
    terminalreporter.write_line(f"fault sweeps {mode}, seed {SWEEP_SEED}: BATCHCTL_TEST_SEED={SWEEP_SEED} repeats them")


@pytest.fixture(autouse=True)
def no_leftover_children() -> Iterator[None]:
    yield
    deadline = time.monotonic() + 5
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert multiprocessing.active_children() == [], "a test left child processes running"


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """60 small photo-like images in three class folders (every tenth a PNG)."""
    root = tmp_path_factory.mktemp("images")
    make_image_folder(root, 60, sides=(240, 420))
    return root


def run_cli(*args: str | os.PathLike[str], timeout: float = 120, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*BATCHCTL, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        **kwargs,  # type: ignore[call-overload]
    )


def start_cli(*args: str | os.PathLike[str]) -> subprocess.Popen[str]:
    """Start the CLI in its own process group, as a shell would, so signals can go to the group."""
    return subprocess.Popen(
        [*BATCHCTL, *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )


def processes_in_group(pgid: int) -> list[int]:
    """Live processes (zombies excluded) whose process group is `pgid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            found.append(int(entry.name))
    return found


def wait_group_gone(pgid: int, timeout: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := processes_in_group(pgid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def wait_for(predicate: object, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, for a test server."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def kill_group(proc: subprocess.Popen[str], sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
