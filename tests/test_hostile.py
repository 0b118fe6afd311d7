"""Never a wrong dataset with exit 0, and never a hang or a traceback: tampered work files and
records, hostile datasets, and what another user left in a shared folder, with the real CLI."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import google_crc32c
import numpy as np
import pytest

import batchctl
from batchctl.read.inspect import verify
from batchctl.store.journal import Untrusted
from batchctl.store.record import read_record
from tests.test_build import image_files

from .conftest import BATCHCTL, PLUGINS, ROOT, kill_group, run_cli, start_cli, wait_for, wait_group_gone

SMALL = ["--resize", "32", "--crop", "32", "--batch-size", "4", "--shard-batches", "2", "--workers", "2"]
SLOW = ["--preprocess", f"{PLUGINS}:slow_image", "--batch-size", "4", "--shard-batches", "2", "--workers", "2"]
OTHER_UID = 65534  # nobody
WITHOUT_CAPS = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"]  # root as a plain user: no DAC override
needs_setpriv = pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv to drop root's powers")


@pytest.fixture(scope="module")
def built(image_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hostile") / "data.zarr"
    result = run_cli("build", image_folder, "-o", out, *SMALL)
    assert result.returncode == 0, result.stderr
    return out


def copy_of(dataset: Path, where: Path) -> Path:
    target = where / dataset.name
    shutil.copytree(dataset, target)  # its record with it
    return target


def fails_in_one_line(result: subprocess.CompletedProcess[str], code: int = 1) -> str:
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("batchctl: error:")]
    assert len(errors) == 1, result.stderr
    return errors[0]


# --- verify checks what a reader reads ---------------------------------------------------------


def test_verify_finds_a_batch_the_shard_index_marks_missing(built: Path, tmp_path: Path) -> None:
    data = copy_of(built, tmp_path)
    shard = data / "image" / "c" / "0" / "0" / "0" / "0"
    raw = bytearray(shard.read_bytes())
    index = np.frombuffer(bytes(raw[-(2 * 16 + 4) : -4]), dtype="<u8").copy().reshape(2, 2)
    index[1] = 2**64 - 1  # batch 1: "no chunk", with a valid index checksum
    raw[-(2 * 16 + 4) : -4] = index.tobytes()
    raw[-4:] = int(google_crc32c.value(bytes(raw[-(2 * 16 + 4) : -4]))).to_bytes(4, "little")
    shard.write_bytes(bytes(raw))
    result = run_cli("verify", data)
    assert result.returncode == 1, result.stderr
    assert "image shard 0: batch 1 is missing from the shard" in result.stderr
    assert "Traceback" not in result.stderr


# --- hostile datasets --------------------------------------------------------------------------


def _array_doc(data: Path, name: str) -> dict:
    return json.loads((data / name / "zarr.json").read_text())


def _put_doc(data: Path, name: str, doc: dict) -> None:
    (data / name / "zarr.json").write_text(json.dumps(doc))


def damage(data: Path, how: str) -> None:
    if how == "fifo shard":
        shard = data / "image" / "c" / "1" / "0" / "0" / "0"
        shard.unlink()
        os.mkfifo(shard)
    elif how == "fifo group zarr.json":
        (data / "zarr.json").unlink()
        os.mkfifo(data / "zarr.json")
    elif how == "fifo array zarr.json":
        (data / "label" / "zarr.json").unlink()
        os.mkfifo(data / "label" / "zarr.json")
    elif how == "enormous row shape":
        doc = _array_doc(data, "image")
        doc["shape"][1] = doc["chunk_grid"]["configuration"]["chunk_shape"][1] = 10**12
        doc["codecs"][0]["configuration"]["chunk_shape"][1] = 10**12
        _put_doc(data, "image", doc)
    elif how == "enormous sample count":
        group = json.loads((data / "zarr.json").read_text())
        attrs = group["attributes"]["batchctl"]
        attrs["num_samples"], attrs["num_batches"] = 4 * 10**15, 10**15
        (data / "zarr.json").write_text(json.dumps(group))
        for name in ("image", "label", "source", "source_index"):
            doc = _array_doc(data, name)
            doc["shape"][0] = 4 * 10**15
            _put_doc(data, name, doc)
    elif how == "wrong types":
        group = json.loads((data / "zarr.json").read_text())
        group["attributes"]["batchctl"]["batch_size"] = "four"
        group["attributes"]["batchctl"]["fields"] = [1, 2]
        (data / "zarr.json").write_text(json.dumps(group))
    elif how == "deep nesting":
        (data / "image" / "zarr.json").write_text("[" * 100_000 + "]" * 100_000)
    elif how == "zero chunk size":
        doc = _array_doc(data, "image")
        doc["codecs"][0]["configuration"]["chunk_shape"][0] = 0
        _put_doc(data, "image", doc)
    else:
        raise AssertionError(how)


HOSTILE = [
    "fifo shard",
    "fifo group zarr.json",
    "fifo array zarr.json",
    "enormous row shape",
    "enormous sample count",
    "wrong types",
    "deep nesting",
    "zero chunk size",
]
OPEN_AND_READ = "import sys, batchctl; ds = batchctl.open(sys.argv[1]); [ds[i] for i in range(len(ds))]"


@pytest.mark.parametrize("how", HOSTILE)
def test_a_hostile_dataset_is_one_line_in_every_command(built: Path, tmp_path: Path, how: str) -> None:
    data = copy_of(built, tmp_path)
    damage(data, how)
    for command in (["info", data], ["verify", data], ["preview", data, "-o", tmp_path / "p.png"]):
        started = time.monotonic()
        result = run_cli(*command, timeout=60)
        assert time.monotonic() - started < 30, (command, how)
        assert result.returncode == 1, (command, how, result.stderr)
        assert "Traceback" not in result.stderr, (command, how, result.stderr)
        assert [line for line in result.stderr.splitlines() if line.startswith("batchctl: error:")], result.stderr
    api = subprocess.run(
        [sys.executable, "-c", OPEN_AND_READ, str(data)], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert api.returncode == 1
    last = api.stderr.strip().splitlines()[-1]
    assert last.startswith(("batchctl.errors.FormatError", "batchctl.errors.DatasetReplacedError")), api.stderr


# --- the work an interrupted build left, tampered ----------------------------------------------


@pytest.fixture
def interrupted(image_folder: Path, tmp_path: Path) -> Path:
    """OUTPUT of a build stopped by SIGINT after some batches were journaled."""
    out = tmp_path / "slow.zarr"
    journal = tmp_path / ".slow.zarr.batchctl" / "journal.jsonl"
    proc = start_cli("build", image_folder, "-o", out, *SLOW)
    wait_for(lambda: journal.exists() and journal.read_text().count('"batch"') >= 2)
    kill_group(proc, signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr
    assert wait_group_gone(proc.pid) == []
    return out


def _tamper_journal(work: Path, how: str) -> None:
    journal = work / "journal.jsonl"
    lines = journal.read_text().splitlines()
    if how == "a billion rows":
        first = json.loads(lines[0])
        first["rows"] = 10**9
        lines[0] = json.dumps(first)
    elif how == "a line that is not an object":
        lines.insert(1, "[1, 2]")
    elif how == "a chunk past any file":
        first = json.loads(lines[0])
        first["chunks"]["image"] = "here"
        lines[0] = json.dumps(first)
    elif how == "a state of the wrong types":
        state = json.loads((work / "state.json").read_text())
        state["classes"] = "cat"
        (work / "state.json").write_text(json.dumps(state))
    elif how == "a journal line nested 200,000 deep":
        lines.insert(1, DEEP)
    elif how == "a state nested 200,000 deep":
        (work / "state.json").write_text(DEEP)
    elif how == "a FIFO for the state":
        (work / "state.json").unlink()
        os.mkfifo(work / "state.json")
    journal.write_text("\n".join(lines) + "\n")


DEEP = "[" * 200_000 + "]" * 200_000  # json.loads raises RecursionError, not ValueError


TAMPERED_WORK = [
    "a billion rows",
    "a line that is not an object",
    "a chunk past any file",
    "a state of the wrong types",
    "a journal line nested 200,000 deep",
    "a state nested 200,000 deep",
    "a FIFO for the state",
]


@pytest.mark.parametrize("how", TAMPERED_WORK)
def test_a_tampered_journal_or_state_is_one_line_then_no_resume_builds(
    image_folder: Path, interrupted: Path, how: str
) -> None:
    _tamper_journal(interrupted.parent / ".slow.zarr.batchctl", how)
    line = fails_in_one_line(run_cli("build", image_folder, "-o", interrupted, *SLOW))
    assert "--no-resume" in line and ("journal" in line or "state.json" in line), line
    assert not interrupted.exists()  # nothing was published
    result = run_cli("build", image_folder, "-o", interrupted, *SLOW, "--no-resume")
    assert result.returncode == 0, result.stderr
    assert verify(interrupted) == []
    assert sorted(str(s) for b in batchctl.open(interrupted) for s in b["source"]) == sorted(image_files(image_folder))


# --- the record of the last build, tampered ----------------------------------------------------


def _tampered_records(raw: str) -> dict[str, str]:
    header, *batches = (json.loads(line) for line in raw.splitlines())
    one_twice = [dict(b) for b in batches]
    one_twice[1] = {**one_twice[1], "files": [one_twice[0]["files"][0], *one_twice[1]["files"][1:]]}
    huge_rows = [dict(b) for b in batches]
    huge_rows[0] = {**huge_rows[0], "rows": 10**9}
    dump = lambda head, lines: "\n".join(json.dumps(x) for x in [head, *lines]) + "\n"  # noqa: E731
    return {
        "one file in two batches": dump(header, one_twice),
        "a billion rows": dump(header, huge_rows),
        "a huge shard count": dump({**header, "shard_batches": 10**12}, batches),
        "a line that is not an object": dump(header, [*batches[:1], [1, 2], *batches[1:]]),
        "a line nested 200,000 deep": dump(header, batches) + DEEP + "\n",
    }


def test_a_tampered_record_is_never_used(image_folder: Path, built: Path, tmp_path: Path) -> None:
    """Checked on its own (as a record without the dataset's hash, from an older batchctl, is), and
    through the CLI, where its hash no longer matches: the next run builds everything, right."""
    record = built / "batchctl.record"
    build_id = json.loads(record.read_text().splitlines()[0])["build_id"]
    for how, text in _tampered_records(record.read_text()).items():
        bad = tmp_path / "bad.record"
        bad.write_text(text)
        with pytest.raises(Untrusted):
            read_record(str(bad), {}, build_id, "")
        folder = tmp_path / how.replace(" ", "-")
        shutil.copytree(image_folder, folder / "src", copy_function=shutil.copy2)
        result = run_cli("build", folder / "src", "-o", folder / "out.zarr", *SMALL)
        assert result.returncode == 0, result.stderr
        (folder / "out.zarr" / "batchctl.record").write_text(
            text.replace(json.dumps(str(image_folder)), json.dumps(str(folder / "src")))
        )
        shutil.copy2(
            folder / "src" / "cat" / sorted(os.listdir(folder / "src" / "cat"))[0], folder / "src" / "cat" / "x.jpg"
        )
        result = run_cli("build", folder / "src", "-o", folder / "out.zarr", *SMALL)
        assert result.returncode == 0, result.stderr
        assert "building everything" in result.stderr and "record" in result.stderr, result.stderr
        assert verify(folder / "out.zarr") == []
        sources = sorted(str(s) for b in batchctl.open(folder / "out.zarr") for s in b["source"])
        assert sources == sorted(image_files(folder / "src")), how


# --- what another user left in a shared folder -------------------------------------------------


def test_a_record_beside_output_not_of_yours_is_neither_trusted_nor_touched(image_folder: Path, tmp_path: Path) -> None:
    """Where batchctl 0.1 kept the record (beside OUTPUT), another user may plant one in a shared
    folder: it is never read for a dataset that holds its own record, and never removed."""
    planted = tmp_path / ".data.zarr.batchctl.record"
    planted.write_text('{"record": 1}\n')
    os.chown(planted, OTHER_UID, OTHER_UID)
    out, src = tmp_path / "data.zarr", tmp_path / "src"
    shutil.copytree(image_folder, src, copy_function=shutil.copy2)
    assert run_cli("build", src, "-o", out, *SMALL).returncode == 0
    shutil.copy2(src / "cat" / sorted(os.listdir(src / "cat"))[0], src / "cat" / "extra.jpg")
    result = run_cli("build", src, "-o", out, *SMALL)
    assert result.returncode == 0 and "building everything" not in result.stderr, result.stderr  # its own record
    assert planted.read_text() == '{"record": 1}\n' and planted.stat().st_uid == OTHER_UID


def test_build_info_replaced_by_a_fifo_or_deep_json_is_not_trusted_and_nothing_hangs(
    image_folder: Path, built: Path, tmp_path: Path
) -> None:
    """The up-to-date check reads the build info: a FIFO in its place would block that read for
    ever, deep JSON would crash the parser. Either is not batchctl's: the build rebuilds."""
    for how in ("fifo", "deep"):
        data = copy_of(built, tmp_path / how)
        info = data / "batchctl.build.json"
        info.unlink()
        if how == "fifo":
            os.mkfifo(info)
        else:
            info.write_text(DEEP)
        source = json.loads((built / "batchctl.build.json").read_text())["source"]
        result = run_cli("build", source, "-o", data, *SMALL, timeout=60)
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
        assert "up to date" not in result.stderr, result.stderr
        assert verify(data) == []


@needs_setpriv
def test_force_over_another_users_dataset_is_refused_before_any_work(built: Path, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    data = copy_of(built, shared)
    for path in [shared, *shared.rglob("*")]:
        os.chown(path, OTHER_UID, OTHER_UID)
    shared.chmod(0o1777)  # like /tmp: anyone may create, only the owner may remove or rename
    source = Path(json.loads((data / "batchctl.build.json").read_text())["source"])
    result = subprocess.run(
        [*WITHOUT_CAPS, *BATCHCTL, "build", source, "-o", data, *SMALL, "--force"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    line = fails_in_one_line(result, code=2)
    assert "belongs to another user" in line and "preprocessed" not in result.stderr, result.stderr
    assert verify(data) == []


@needs_setpriv
def test_another_users_lock_names_the_holder_or_says_nobody_holds_it(image_folder: Path, tmp_path: Path) -> None:
    lock = tmp_path / ".data.zarr.batchctl.lock"
    lock.write_text("4242\n")
    os.chown(lock, OTHER_UID, OTHER_UID)
    command = [*WITHOUT_CAPS, *BATCHCTL, "build", str(image_folder), "-o", str(tmp_path / "data.zarr"), *SMALL]
    free = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)
    line = fails_in_one_line(free, code=2)
    assert "belongs to" in line and "no build holds it" in line, line
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1]); fcntl.flock(f, fcntl.LOCK_EX); "
         "print('held', flush=True); time.sleep(60)", str(lock)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        held = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=ROOT)
    finally:
        holder.kill()
        holder.wait()
    line = fails_in_one_line(held, code=1)
    assert "another build of this output is running (process 4242" in line, line


@needs_setpriv
def test_an_up_to_date_rerun_in_a_folder_it_cannot_write_says_up_to_date(built: Path, tmp_path: Path) -> None:
    folder = tmp_path / "readonly"
    folder.mkdir()
    data = copy_of(built, folder)
    (folder / ".data.zarr.batchctl.lock").unlink(missing_ok=True)
    source = json.loads((data / "batchctl.build.json").read_text())["source"]
    folder.chmod(0o555)
    try:
        result = subprocess.run(
            [*WITHOUT_CAPS, *BATCHCTL, "build", source, "-o", str(data), *SMALL],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
        )  # fmt: skip
    finally:
        folder.chmod(0o755)
    assert result.returncode == 0, result.stderr
    assert "up to date" in result.stderr


# --- minor ------------------------------------------------------------------------------------


def test_preview_of_a_batch_out_of_range_is_a_usage_error(built: Path, tmp_path: Path) -> None:
    line = fails_in_one_line(run_cli("preview", built, "-o", tmp_path / "p.png", "--batch", "999"), code=2)
    assert "--batch" in line


def test_a_file_retried_after_a_transient_failure_is_reported_as_retried(image_folder: Path, tmp_path: Path) -> None:
    victim = sorted(image_files(image_folder))[3]
    crash = ["--preprocess", f"{PLUGINS}:crash_on", "--option", f"name={Path(victim).name}"]
    options = [*crash, "--batch-size", "4", "--shard-batches", "2", "--workers", "2"]
    first = run_cli("build", image_folder, "-o", tmp_path / "data.zarr", *options)
    assert first.returncode == 0, first.stderr
    again = run_cli("build", image_folder, "-o", tmp_path / "data.zarr", *options, "--report", tmp_path / "r.json")
    assert again.returncode == 0, again.stderr
    assert "0 added, 0 changed, 0 removed, 1 retried since the last build" in again.stderr, again.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["retried"]["paths"] == [victim] and report["changed"]["count"] == 0


def test_verify_of_a_dataset_claiming_a_quadrillion_samples_is_bounded_by_the_disk(built: Path, tmp_path: Path) -> None:
    import resource

    data = copy_of(built, tmp_path)
    group = json.loads((data / "zarr.json").read_text())
    attrs = group["attributes"]["batchctl"]
    attrs["num_samples"], attrs["num_batches"] = 10**15, 10**15 // attrs["batch_size"]
    attrs["num_shards"] = -(-attrs["num_batches"] // attrs["shard_batches"])
    for doc in group["consolidated_metadata"]["metadata"].values():
        doc["shape"][0] = 10**15
    (data / "zarr.json").write_text(json.dumps(group))
    for doc_path in data.glob("*/zarr.json"):
        doc = json.loads(doc_path.read_text())
        doc["shape"][0] = 10**15
        doc_path.write_text(json.dumps(doc))

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))

    result = subprocess.run(
        [*BATCHCTL, "verify", str(data)], capture_output=True, text=True, timeout=120, cwd=ROOT, preexec_fn=limited
    )
    line = fails_in_one_line(result)
    assert "problems found" in line and "shard file is missing" in result.stderr, result.stderr[-2000:]
