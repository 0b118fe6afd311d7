"""Trust under every signal, and no planted-file tricks: the real CLI, stopped the ways schedulers
and people stop it. Each test counts only its own build's processes (tagged in their environment)
and /dev/shm names (they carry the build's pid), and times from the signal."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from batchctl.synthetic import make_image_folder
from tests.conftest import BATCHCTL, PLUGINS, ROOT, run_cli, sweep, sweep_rng, wait_for, wait_group_gone
from tests.stress import expected_codes, plan, run_trial


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("photos")
    make_image_folder(root, 240, sides=(300, 560))
    return root


def test_every_signal_at_any_moment_ends_cleanly(photos: Path, tmp_path: Path) -> None:
    """Random moments (8; 20 in make test-long) across {SIGINT, SIGTERM} x {parent, group}, a third
    of them in the first second, the rest across the run and its publish; then SIGKILLs of the
    parent alone (2; 3). Every
    one: the right exit code within 5 s of the signal, no traceback, no process of the build alive
    3 s after its exit, no /dev/shm name left, and a complete dataset exactly when it exits 0; after
    a SIGKILL, nothing at all on stderr (the build's other processes see their parent gone)."""
    args = ["build", str(photos), "--workers", "2", "--batch-size", "64", "-q"]
    started = time.monotonic()
    whole = run_cli(*args, "-o", tmp_path / "whole.zarr")
    run_s = time.monotonic() - started  # the plan spreads the signals over a run as long as this one
    assert whole.returncode == 0, whole.stderr
    failures, killed = [], 0
    for n, (sig, target, delay) in enumerate(plan(sweep_rng("every signal"), sweep(8, 20), sweep(2, 3), run_s)):
        trial = run_trial(args, tmp_path / f"out{n}.zarr", sig, target, delay)
        killed += trial.code == -9
        if not trial.ok(expected_codes(sig), run_s) or (trial.exit_s or 99) > 5:
            failures.append(trial.line() + "\n" + trial.stderr[-500:])
    assert failures == []
    assert killed >= 1  # a SIGKILL came while the build ran (each at most 70% through one as long)


def test_a_signal_once_the_dataset_is_in_place_ends_the_build_as_finished(photos: Path, tmp_path: Path) -> None:
    """SIGTERM while the build deletes its old work, after the dataset was put in place: the
    build is finished (exit 0, its summary), not "interrupted" beside a complete dataset (the
    random-moment sweep above once caught such a 143 at the publish)."""
    code = (
        "import os, runpy, signal, sys\n"
        "from batchctl.run import staging\n"
        "def discard(self, original=staging.LocalWorkdir.discard):\n"
        "    if self.paths.output.exists():  # (during the publish: the dataset is in place)\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "    original(self)\n"
        "staging.LocalWorkdir.discard = discard\n"
        "sys.argv = ['batchctl', *sys.argv[1:]]\n"
        "runpy.run_module('batchctl', run_name='__main__')\n"
    )
    out = tmp_path / "out.zarr"
    args = ["build", str(photos), "-o", str(out), "--workers", "2", "--resize", "32", "--crop", "32"]
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "interrupted" not in result.stderr and "Built" in result.stderr, result.stderr
    assert run_cli("verify", out).returncode == 0


def test_a_planted_symlink_at_the_lock_is_refused(photos: Path, tmp_path: Path) -> None:
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    (tmp_path / ".out.zarr.batchctl.lock").symlink_to(victim)
    result = run_cli("build", photos, "-o", tmp_path / "out.zarr", "--workers", "1")
    assert result.returncode == 2
    assert "is a symbolic link" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert victim.read_text() == "keep me"


def test_a_work_folder_that_is_not_private_is_not_trusted(photos: Path, tmp_path: Path) -> None:
    """A planted work folder (a journal in it would steer what a resume keeps) is refused."""
    workdir = tmp_path / ".out.zarr.batchctl"
    workdir.mkdir(mode=0o777)
    workdir.chmod(0o777)
    result = run_cli("build", photos, "-o", tmp_path / "out.zarr", "--workers", "1")
    assert result.returncode == 2
    assert "not a private folder of yours" in result.stderr
    workdir.chmod(0o700)  # private now: trusted
    small = ["--workers", "2", "--resize", "32", "--crop", "32"]
    result = run_cli("build", photos, "-o", tmp_path / "out.zarr", *small)
    assert result.returncode == 0, result.stderr


def test_a_signal_raised_in_a_finalizer_prints_no_traceback() -> None:
    """A signal whose handler raises while Python runs a `__del__` cannot propagate; Python would
    print it as "Exception ignored". It was noted, so batchctl reports nothing (other unraisable
    errors still print), and the next checkpoint acts on it."""
    code = (
        "import gc, sys\n"
        "from batchctl.run.signals import Signalled, check_signalled, quiet_unraisable_signals, raise_signalled\n"
        "quiet_unraisable_signals()\n"
        "class Stopped:\n"
        "    def __del__(self): raise_signalled(15)\n"
        "class Broken:\n"
        "    def __del__(self): raise ValueError('other')\n"
        "Stopped(); Broken(); gc.collect()\n"
        "try:\n"
        "    check_signalled()\n"
        "except Signalled as exc:\n"
        "    print('acted on', exc.signum)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "acted on 15"
    assert "Signalled" not in result.stderr and "ValueError: other" in result.stderr


def test_a_finished_command_exits_at_once_leaving_nothing_behind(photos: Path, tmp_path: Path) -> None:
    """The CLI skips the interpreter's teardown (`__main__.exit_now`) and starts the fork server
    before parsing its options: still the report is whole, the build's semaphores are unlinked
    (no resource-tracker warning), every helper has closed the output pipes when the caller reads
    to their end, and a command that needs no fork server (an up-to-date rerun, a usage error,
    `--help`) ends the same way."""
    from tests.stress import build_names

    out, report = tmp_path / "d.zarr", tmp_path / "report.json"
    for args, code in [
        (["build", photos, "-o", out, "--quiet", "--report", report], 0),
        (["build", photos, "-o", out, "--quiet"], 0),  # up to date: the fork server went unused
        (["build", tmp_path / "missing", "-o", tmp_path / "x.zarr"], 2),
        (["build", "--help"], 0),
    ]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "batchctl", *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        stdout, stderr = proc.communicate(timeout=120)  # returns once every holder of the pipes is gone
        assert proc.returncode == code, stderr
        assert build_names(proc.pid) == []
        assert "leaked" not in stderr and "Traceback" not in stderr
        if "--help" in args:
            assert "SOURCE" in stdout  # flushed before the fast exit
        elif code == 0:
            assert stdout == "" and stderr == ""
    assert json.loads(report.read_text())["status"] == "complete"


def test_only_a_local_build_starts_the_fork_server_early() -> None:
    from batchctl.__main__ import builds_locally

    assert builds_locally(["build", "data", "-o", "x.zarr", "--workers", "2"])
    assert builds_locally(["build", "engine", "--engine", "local"])
    assert not builds_locally(["build", "data", "--engine", "dask"])
    assert not builds_locally(["build", "data", "--engine=dask"])
    assert not builds_locally(["build", "--help"])
    assert not builds_locally(["info", "data.zarr"])
    assert not builds_locally([])


def test_a_script_calling_build_outside_the_main_guard_fails_in_one_line(photos: Path, tmp_path: Path) -> None:
    """multiprocessing re-runs the main script in every child it starts: a script that calls
    build() at its top level (no `if __name__ == "__main__":`) had every worker and the collator
    start a build of their own, printed thousands of traceback lines, and blamed the collator.
    Now the children leave quietly and the build fails at once saying what to change; with the
    guard, the same call builds."""
    from tests.stress import build_names

    call = (
        "try:\n"
        f"    batchctl.build({str(photos)!r}, {str(tmp_path / 'd.zarr')!r}, workers=2)\n"
        "except batchctl.BuildFailed as exc:\n"
        "    sys.exit(f'failed: {exc}')\n"
        "print('built')\n"
    )
    guarded = "if __name__ == '__main__':\n" + "".join(f"    {line}\n" for line in call.splitlines())
    for body, code, out, err in [
        (
            call,
            1,
            "",
            "failed: the script calling batchctl.build() runs it again in every process the build starts "
            '(multiprocessing imports the main script in each); put the call under `if __name__ == "__main__":`\n',
        ),
        (guarded, 0, "built\n", ""),
    ]:
        script = tmp_path / "make_dataset.py"
        script.write_text("import sys\nimport batchctl\n" + body)
        proc = subprocess.Popen([sys.executable, script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        stdout, stderr = proc.communicate(timeout=60)
        assert (proc.returncode, stdout, stderr) == (code, out, err)
        assert build_names(proc.pid) == []


def test_a_build_from_a_program_on_standard_input_is_refused_in_one_line(photos: Path, tmp_path: Path) -> None:
    """`python - <<EOF`: each child would look for the main script's file, find none and print a
    traceback, hundreds of times; the build is refused before it starts any process."""
    program = (
        "import sys\n"
        "import batchctl\n"
        "try:\n"
        f"    batchctl.build({str(photos)!r}, {str(tmp_path / 'd.zarr')!r}, workers=2)\n"
        "except batchctl.UsageError as exc:\n"
        "    sys.exit(f'refused: {exc}')\n"
    )
    result = subprocess.run(
        [sys.executable, "-"], input=program, capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == (
        "refused: a build cannot start its processes from a program read from standard input: each runs the "
        f"main script again, and {tmp_path / '<stdin>'} is not a file; save the program to a file and run that\n"
    )
    assert not (tmp_path / "d.zarr").exists()


@pytest.mark.parametrize("moment", [0.3, 1.5])
def test_a_sigkill_of_the_parent_alone_leaves_no_temporary_folder(
    photos: Path, tmp_path: Path, moment: float, request: pytest.FixtureRequest
) -> None:
    """multiprocessing's folder for the fork server's socket (pymp-batchctl-PID-*, in this run's
    own TMPDIR) goes with the fork server when the parent is killed, not at the next build."""
    temp = Path(tempfile.mkdtemp(prefix="bt-", dir="/tmp"))  # (short: the socket's path must fit 107 bytes)
    request.addfinalizer(lambda: shutil.rmtree(temp, True))
    args = ["build", str(photos), "-o", str(tmp_path / "out.zarr"), "--workers", "2", "-q"]
    args += ["--preprocess", f"{PLUGINS}:slow_image"]
    proc = subprocess.Popen(
        [*BATCHCTL, *args], cwd=ROOT, env={**os.environ, "TMPDIR": str(temp)}, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    wait_for(lambda: any(temp.glob(f"pymp-batchctl-{proc.pid}-*")), timeout=30)
    time.sleep(moment)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert wait_group_gone(proc.pid) == []
    assert sorted(p.name for p in temp.iterdir()) == []
    assert proc.stderr is not None and proc.stderr.read() == ""
