"""A plugin that reads other files than its input (`@reads`): a sidecar beside each input or a
file all inputs share. Editing one rebuilds exactly the inputs that read it. The real CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import batchctl
from tests.conftest import run_cli

PLUGIN = '''
import json
from pathlib import Path

import numpy as np
from batchctl.preprocess import reads


@reads("{stem}.json", "scale.txt")
def boxed(path: Path) -> dict:
    """The array times the shared scale, and the box count from the sidecar (0 without one)."""
    scale = float((ROOT / "scale.txt").read_text())
    sidecar = path.with_suffix(".json")
    boxes = len(json.loads(sidecar.read_text())["boxes"]) if sidecar.exists() else 0
    return {"array": np.load(path) * scale, "boxes": boxes}
'''


def make_source(src: Path) -> None:
    for sub in ("a", "b"):
        (src / sub).mkdir(parents=True)
        for i in range(3):
            np.save(src / sub / f"x{i}.npy", np.full(2, i, np.float32))
            (src / sub / f"x{i}.json").write_text(json.dumps({"boxes": [[0, 0, 1, 1]] * (i + 1)}))
    (src / "scale.txt").write_text("1")


def rows(out: Path) -> dict[str, tuple[list[float], int]]:
    found = {}
    for batch in batchctl.open(out):
        for i, source in enumerate(batch["source"]):
            found[str(source)] = (batch["array"][i].tolist(), int(batch["boxes"][i]))
    return found


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, Path, list[str]]:
    src = tmp_path / "src"
    make_source(src)
    plugin = tmp_path / "boxed.py"
    plugin.write_text(PLUGIN + f"\nROOT = Path({str(src)!r})\n")
    out, report = tmp_path / "o.zarr", tmp_path / "r.json"
    args = [
        "build",
        str(src),
        "-o",
        str(out),
        "--preprocess",
        f"{plugin}:boxed",
        "--batch-size",
        "2",
        "--workers",
        "2",
        "--report",
        str(report),
    ]
    return src, report, args


def report_of(path: Path) -> dict[str, object]:
    data: dict[str, object] = json.loads(path.read_text())
    return data


def test_an_edited_sidecar_rebuilds_its_input_alone_and_the_sidecars_are_no_inputs(
    setup: tuple[Path, Path, list[str]],
) -> None:
    src, report, args = setup
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr
    out = Path(args[3])
    assert rows(out) == {f"{s}/x{i}.npy": ([float(i)] * 2, i + 1) for s in "ab" for i in range(3)}
    assert report_of(report)["ignored"]["count"] == 7  # type: ignore[index]  # the sidecars and scale.txt: no inputs
    assert "up to date" in run_cli(*args).stderr

    sidecar = src / "b" / "x1.json"
    sidecar.write_text(json.dumps({"boxes": [[0, 0, 2, 2]] * 7}))
    edited = run_cli(*args)
    assert edited.returncode == 0, edited.stderr
    data = report_of(report)
    assert data["processed"] == 1 and data["changed"]["paths"] == ["b/x1.npy"]  # type: ignore[index]
    assert rows(out)["b/x1.npy"] == ([1.0, 1.0], 7)

    sidecar.unlink()  # a sidecar that goes away is a change too
    assert run_cli(*args).returncode == 0
    assert report_of(report)["processed"] == 1 and rows(out)["b/x1.npy"] == ([1.0, 1.0], 0)


def test_an_edited_shared_file_rebuilds_every_input(setup: tuple[Path, Path, list[str]]) -> None:
    src, report, args = setup
    assert run_cli(*args).returncode == 0
    scale = src / "scale.txt"
    scale.write_text("3")
    os.utime(scale, ns=(scale.stat().st_atime_ns, scale.stat().st_mtime_ns + 10**9))
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr
    assert report_of(report)["processed"] == 6
    assert rows(Path(args[3]))["a/x2.npy"] == ([6.0, 6.0], 3)


@pytest.mark.parametrize(
    ("declared", "said"),
    [
        ("'../elsewhere.csv'", "must stay inside SOURCE"),
        ("'{path}.json'", "may hold only {stem} and {name}"),
        ("", "needs at least one"),
    ],
)
def test_a_bad_reads_declaration_is_one_usage_error(tmp_path: Path, declared: str, said: str) -> None:
    src = tmp_path / "src"
    make_source(src)
    plugin = tmp_path / "bad.py"
    plugin.write_text(
        f"from batchctl.preprocess import reads\n\n@reads({declared})\ndef fn(path):\n    return {{'x': 1}}\n"
    )
    result = run_cli("build", src, "-o", tmp_path / "o.zarr", "--preprocess", f"{plugin}:fn")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], result.stderr
    assert not (tmp_path / "o.zarr").exists()
