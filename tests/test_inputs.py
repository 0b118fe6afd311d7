"""Python inputs: `batchctl.build(inputs, output, preprocess=fn)` over an iterable of records or
paths, and over a map-style dataset. Each test runs a real script in its own process (its
function defined in the script, as users write them), with real workers."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

import batchctl
from tests.conftest import ROOT, kill_group, sweep, sweep_rng, wait_group_gone

SCRIPT = '''
import json
import os
import sys
import time

import numpy as np

import batchctl


def scaled(item, power: int = 1):
    """A record: its value to the power, and its text's length; a record marked bad raises."""
    if item.get("bad"):
        raise ValueError(f"record {item['id']} is marked bad")
    time.sleep(item.get("delay", 0))
    return {"value": np.float32(item["value"]) ** power, "length": len(item["text"])}


class Numbers:
    """A map-style dataset: its items are made where they are read (in the workers)."""

    def __init__(self, count):
        self.count = count

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        return np.full(3, index, np.float32), os.getpid()


def from_dataset(item):
    array, pid = item
    if int(array[0]) == 5:
        raise ValueError("five is refused")
    return {"array": array, "pid": pid}


if __name__ == "__main__":
    mode, given, output, report = sys.argv[1:5]
    options = dict(batch_size=4, workers=2, report=report, quiet=True, seed=0)
    print("building", flush=True)
    try:
        if mode == "records":
            records = json.loads(open(given).read())
            name = lambda r: r["id"]  # noqa: E731
            batchctl.build(records, output, preprocess=scaled, input_key=name, option={"power": 2}, **options)
        elif mode == "paths":
            batchctl.build(json.loads(open(given).read()), output, preprocess="npy", **options)
        else:
            batchctl.build(Numbers(int(given)), output, preprocess=from_dataset, **options)
        print("built", flush=True)
    except (batchctl.BuildInterrupted, KeyboardInterrupt):
        sys.exit(130)
    except batchctl.UsageError as exc:
        print(f"usage: {exc}", file=sys.stderr)
        sys.exit(2)
    print(os.getpid())
'''


def run_script(tmp_path: Path, *args: object, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "make_dataset.py"
    script.write_text(SCRIPT)
    return subprocess.run(
        [sys.executable, script, *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def rows(out: Path) -> dict[str, dict[str, object]]:
    found: dict[str, dict[str, object]] = {}
    for batch in batchctl.open(out):
        for i, source in enumerate(batch["source"]):
            found[str(source)] = {k: batch[k][i].tolist() for k in batch if k not in ("source", "source_index")}
    return found


def records(count: int) -> list[dict[str, object]]:
    return [{"id": f"r{i:02d}", "value": i, "text": "t" * i} for i in range(count)]


def test_records_build_with_their_keys_and_an_edited_record_rebuilds_alone(tmp_path: Path) -> None:
    given, out, report = tmp_path / "records.json", tmp_path / "o.zarr", tmp_path / "r.json"
    items = records(10) + [{"id": "r03", "value": 99, "text": "again"}, {"id": "bad", "value": 0, "text": "", "bad": 1}]
    given.write_text(json.dumps(items))
    first = run_script(tmp_path, "records", given, out, report)
    assert first.returncode == 0, first.stderr
    assert rows(out) == {f"r{i:02d}": {"value": float(i * i), "length": i} for i in range(10)}
    errors = {e["source"]: e["error"] for e in json.loads(report.read_text())["errors"]}
    assert errors == {
        "r03": "input 10 has the key of input 3; give input_key= a function naming each uniquely",
        "bad": "ValueError: record bad is marked bad",
    }
    pid = int(first.stdout.split()[-1])
    assert not list(Path(tempfile.gettempdir()).glob(f"pymp-batchctl-{pid}-*"))  # its spill, gone

    assert run_script(tmp_path, "records", given, out, report).returncode == 0
    assert json.loads(report.read_text())["status"] == "up_to_date"
    items[4] = {"id": "r04", "value": 7, "text": "seven"}
    items.append({"id": "r10", "value": 10, "text": "ten"})
    given.write_text(json.dumps(items))
    edited = run_script(tmp_path, "records", given, out, report)
    assert edited.returncode == 0, edited.stderr
    data = json.loads(report.read_text())
    assert data["processed"] == 2  # the edited record and the new one (the bad one, unchanged, stays skipped)
    assert data["changed"]["paths"] == ["r04"] and data["added"]["paths"] == ["r10"]
    assert rows(out)["r04"] == {"value": 49.0, "length": 5} and rows(out)["r10"] == {"value": 100.0, "length": 3}
    assert batchctl.open(out).num_samples == 11


def test_a_list_of_paths_takes_a_built_in_and_an_edited_file_rebuilds_alone(tmp_path: Path) -> None:
    folder = tmp_path / "arrays"
    folder.mkdir()
    paths = []
    for i in range(6):
        np.save(folder / f"a{i}.npy", np.full(2, i, np.int16))
        paths.append(str(folder / f"a{i}.npy"))
    given, out, report = tmp_path / "paths.json", tmp_path / "o.zarr", tmp_path / "r.json"
    given.write_text(json.dumps(paths + [str(folder / "gone.npy")]))
    assert run_script(tmp_path, "paths", given, out, report).returncode == 0
    assert rows(out) == {p: {"array": [i, i]} for i, p in enumerate(paths)}
    assert [e["source"] for e in json.loads(report.read_text())["errors"]] == [str(folder / "gone.npy")]
    np.save(folder / "a2.npy", np.full(2, 42, np.int16))
    os.utime(folder / "a2.npy", ns=(0, (folder / "a2.npy").stat().st_mtime_ns + 10**9))
    assert run_script(tmp_path, "paths", given, out, report).returncode == 0
    data = json.loads(report.read_text())
    assert data["changed"]["paths"] == [paths[2]] and rows(out)[paths[2]] == {"array": [42, 42]}


def test_a_map_style_dataset_is_read_in_the_workers(tmp_path: Path) -> None:
    out, report = tmp_path / "o.zarr", tmp_path / "r.json"
    result = run_script(tmp_path, "dataset", 20, out, report)
    assert result.returncode == 0, result.stderr
    found = rows(out)
    assert sorted(found, key=int) == [str(i) for i in range(20) if i != 5]
    assert all(row["array"] == [float(int(key))] * 3 for key, row in found.items())
    parent = int(result.stdout.split()[-1])
    assert parent not in {row["pid"] for row in found.values()}  # __getitem__ ran in the workers
    assert [e["error"] for e in json.loads(report.read_text())["errors"]] == ["ValueError: five is refused"]


def test_python_inputs_killed_at_random_moments_end_with_the_same_bytes(tmp_path: Path) -> None:
    from tests.test_reproducible import tree

    given = tmp_path / "records.json"
    given.write_text(json.dumps([{**r, "delay": 0.03} for r in records(60)]))
    script = tmp_path / "make_dataset.py"
    script.write_text(SCRIPT)
    whole = tmp_path / "whole.zarr"
    assert run_script(tmp_path, "records", given, whole, tmp_path / "w.json").returncode == 0
    rng: random.Random = sweep_rng("python inputs interrupted")
    for trial in range(sweep(2, 6)):
        out, happened = tmp_path / f"t{trial}.zarr", []
        for _ in range(rng.randint(1, 3)):
            proc = subprocess.Popen(
                [sys.executable, script, "records", given, out, tmp_path / "r.json"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
                start_new_session=True,
            )
            sig = rng.choice([signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
            assert (
                proc.stdout is not None and proc.stdout.readline() == "building\n"
            )  # (the script's own start-up: its business)
            time.sleep(rng.uniform(0.0, 1.5))
            kill_group(proc, sig)
            printed, err = proc.communicate(timeout=60)
            assert wait_group_gone(proc.pid) == []
            # -15: a SIGTERM before build() took the signals; -2: a SIGINT once build() had
            # returned and the interpreter let go of its handlers on its way out
            assert proc.returncode in (0, 130, -9, -15) or (proc.returncode == -2 and "built" in printed), err
            assert "Traceback" not in err, err
            if proc.returncode in (0, 130):  # ended by build() itself: its spill is gone
                assert not list(Path(tempfile.gettempdir()).glob(f"pymp-batchctl-{proc.pid}-*"))
            happened.append(f"{sig.name} -> {proc.returncode}")
        assert run_script(tmp_path, "records", given, out, tmp_path / "r.json").returncode == 0
        assert tree(out) == tree(whole), f"trial {trial}: {happened}"


@pytest.mark.parametrize(
    ("call", "said"),
    [
        ("batchctl.build([1, 2], 'o.zarr', preprocess=lambda x: {'x': x})", "define it at the top level"),
        (
            "batchctl.build([{'value': 1}, lambda: 0], 'o.zarr', preprocess=scaled)",
            "input 1 (1) cannot be pickled for the workers",
        ),
        ("batchctl.build([1, 2], preprocess=scaled)", "needs an output path"),
        ("batchctl.build([1, 2], 'o.zarr', preprocess=scaled, engine='dask')", "engine='local'"),
        ("batchctl.build([1, 2], 'o.zarr', preprocess=scaled, label='kind')", "label= chooses among a SOURCE's files"),
        ("batchctl.build([1, 2], 'o.zarr', preprocess=scaled, input_key=abs)", "non-empty str"),
        ("batchctl.build('.', 'o.zarr', input_key=str)", "input_key= names Python inputs"),
    ],
)
def test_what_python_inputs_cannot_take_is_one_usage_error(tmp_path: Path, call: str, said: str) -> None:
    script = tmp_path / "bad.py"
    script.write_text(SCRIPT.split("if __name__")[0] + f"if __name__ == '__main__':\n    {call}\n")
    result = subprocess.run([sys.executable, script], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert result.returncode != 0
    assert said in result.stderr.strip().splitlines()[-1], result.stderr
    assert not (tmp_path / "o.zarr").exists()


def test_a_dict_of_inputs_is_one_usage_error(tmp_path: Path) -> None:
    script = tmp_path / "bad.py"
    call = "batchctl.build({'a': {'value': 1}}, 'o.zarr', preprocess=scaled)"
    script.write_text(SCRIPT.split("if __name__")[0] + f"if __name__ == '__main__':\n    {call}\n")
    result = subprocess.run([sys.executable, script], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert result.returncode != 0 and "not a dict: give it the dict's .values() or .items()" in result.stderr
