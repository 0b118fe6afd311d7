"""Right by default: what a new user and a fault campaign ran into, and the README's quick start.
The real CLI in subprocesses, as a user runs it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

import batchctl
from tests.conftest import BATCHCTL, ROOT

PLUGIN = """
import numpy as np

def tokens(path, length=4):
    return {"tokens": np.full(length, len(path.read_bytes()), dtype=np.int32)}
"""


def texts(root: Path, count: int = 6) -> Path:
    src = root / "texts"
    src.mkdir()
    for i in range(count):
        (src / f"t{i}.txt").write_text("x" * (i + 1))
    return src


def run_in(folder: Path, *args: str | Path) -> tuple[int, str]:
    """The CLI run from `folder` (batchctl importable from anywhere, as once installed)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [*BATCHCTL, *map(str, args)], capture_output=True, text=True, cwd=folder, env=env, timeout=120
    )
    return done.returncode, done.stderr


def test_editing_the_plugin_rebuilds_and_says_why(tmp_path: Path) -> None:
    src = texts(tmp_path)
    plugin = tmp_path / "tok.py"
    plugin.write_text(PLUGIN)
    args = ("build", src, "-o", tmp_path / "tokens.zarr", "--preprocess", f"{plugin}:tokens", "--include", "*.txt")
    assert run_in(tmp_path, *args)[0] == 0
    assert run_in(tmp_path, *args)[1].count("up to date") == 1
    plugin.write_text(PLUGIN.replace("length=4", "length=6"))  # a default changed: every row changes
    code, err = run_in(tmp_path, *args)
    assert code == 0, err
    assert "building everything: the preprocessor's code changed: tok.py" in err  # named as the dataset names it
    assert batchctl.open(tmp_path / "tokens.zarr").fields["tokens"][0] == (6,)
    assert "up to date" in run_in(tmp_path, *args)[1]


def test_the_same_plugin_typed_from_another_folder_is_the_same_build(tmp_path: Path) -> None:
    src = texts(tmp_path)
    (tmp_path / "tok.py").write_text(PLUGIN)
    sub = tmp_path / "sub"
    sub.mkdir()
    out = tmp_path / "tokens.zarr"
    assert run_in(tmp_path, "build", src, "-o", out, "--preprocess", "tok.py:tokens", "--include", "*.txt")[0] == 0
    code, err = run_in(sub, "build", src, "-o", out, "--preprocess", "../tok.py:tokens", "--include", "*.txt")
    assert code == 0 and "up to date" in err, err
    rows = np.concatenate([b["tokens"] for b in batchctl.open(out)])
    assert sorted(rows[:, 0].tolist()) == [1, 2, 3, 4, 5, 6]


def test_output_into_folders_not_made_yet_makes_them(tmp_path: Path) -> None:
    src = texts(tmp_path)
    (tmp_path / "tok.py").write_text(PLUGIN)
    out = tmp_path / "runs" / "2026" / "tokens.zarr"
    code, err = run_in(tmp_path, "build", src, "-o", out, "--preprocess", "tok.py:tokens", "--include", "*.txt")
    assert code == 0, err
    assert batchctl.open(out).num_samples == 6
    (tmp_path / "blocked").write_text("a file where a folder should be")
    code, err = run_in(
        tmp_path, "build", src, "-o", tmp_path / "blocked" / "x" / "t.zarr", "--preprocess", "tok.py:tokens"
    )
    assert code == 2 and err.count("\n") == 1 and "cannot make OUTPUT's folder" in err, err


def test_an_option_of_the_wrong_type_is_one_line_before_any_work(tmp_path: Path) -> None:
    src = texts(tmp_path, count=8)
    (tmp_path / "tok.py").write_text(PLUGIN)
    base = ("build", src, "-o", tmp_path / "t.zarr", "--preprocess", "tok.py:tokens", "--include", "*.txt")
    code, err = run_in(tmp_path, *base, "--option", "length=abc")
    assert code == 2 and err.count("\n") == 1, err
    assert "option length: expected an integer, got 'abc'" in err
    assert not (tmp_path / "t.zarr").exists()
    code, err = run_in(tmp_path, "build", src, "-o", tmp_path / "i.zarr", "--option", "resize=big")
    assert code == 2 and "option resize: expected an integer, got 'big'" in err, err


def test_many_files_failing_for_one_reason_are_counted_not_listed(tmp_path: Path) -> None:
    src = texts(tmp_path, count=12)
    (tmp_path / "bad.py").write_text("def broken(path):\n    raise TypeError('this plugin is broken')\n")
    report = tmp_path / "r.json"
    out = tmp_path / "b.zarr"
    args = ("--preprocess", "bad.py:broken", "--include", "*.txt", "--report", report)
    code, err = run_in(tmp_path, "build", src, "-o", out, *args)
    assert code == 1
    assert err.count("TypeError: this plugin is broken") == 5, err  # 3 files named, the note, the count
    assert "skipped 12 files: TypeError: this plugin is broken (the first" in err
    assert len(json.loads(report.read_text())["errors"]) == 12


API_SCRIPT = """
import json, os, signal, sys
from multiprocessing import process
import batchctl

def mine(signum, frame):
    pass

def state():
    return (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), sys.unraisablehook,
            sys.excepthook, dict(os.environ), signal.pthread_sigmask(signal.SIG_BLOCK, []),
            process.current_process()._config.get("semprefix"))

if __name__ == "__main__":
    signal.signal(signal.SIGINT, mine)
    signal.signal(signal.SIGTERM, mine)
    sys.unraisablehook = lambda unraisable: None
    before = state()
    src, out, report = sys.argv[1:4]
    result = batchctl.build(src, out, strict=True, resize=40, crop=32, sorted=True, option={"draft": False},
                            workers=1, report=report)
    changed = [name for name, a, b in zip(("SIGINT", "SIGTERM", "unraisablehook", "excepthook", "environ",
                                           "sigmask", "semprefix"), before, state()) if a != b]
    print("CHANGED", changed)
    try:
        batchctl.build(src, out, strcit=True)
    except batchctl.UsageError as exc:
        print("REFUSED", exc)
    print(json.dumps({"status": result.status, "samples": result.samples}))
"""


def test_the_python_api_takes_the_cli_options_by_their_names(tmp_path: Path) -> None:
    from batchctl.synthetic import make_image_folder

    make_image_folder(tmp_path / "imgs", 9, sides=(50, 70))
    (tmp_path / "script.py").write_text(API_SCRIPT)
    out, report = tmp_path / "api.zarr", tmp_path / "r.json"
    done = subprocess.run(
        [sys.executable, "script.py", str(tmp_path / "imgs"), str(out), str(report)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    assert '{"status": "complete", "samples": 9}' in done.stdout
    assert "CHANGED []" in done.stdout  # the caller's handlers, hooks, environment and naming are its own again
    assert "REFUSED build() takes no option strcit; its options are" in done.stdout
    ds = batchctl.open(out)
    assert ds.fields["image"][0] == (32, 32, 3)
    assert json.loads(report.read_text())["status"] == "complete"
    sources = [str(s) for b in ds for s in b["source"]]
    assert sources == sorted(sources)  # sorted=True: dispatched in path order, one worker


def test_shell_completion_is_offered() -> None:
    script = Path(sys.executable).parent / "batchctl"  # the console script the install made
    # the script --install-completion writes (--show-completion takes no shell: it detects the one it
    # runs under, and finds none without a terminal, as here in CI)
    source = {**os.environ, "_BATCHCTL_COMPLETE": "source_bash"}
    done = subprocess.run([str(script)], capture_output=True, text=True, timeout=60, env=source)
    assert done.returncode == 0 and "_BATCHCTL_COMPLETE" in done.stdout, done.stderr
    words = subprocess.run(
        [str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "_BATCHCTL_COMPLETE": "complete_bash", "COMP_WORDS": "batchctl bu", "COMP_CWORD": "1"},
    )
    assert "build" in words.stdout.split()


def test_summaries_say_what_happened(tmp_path: Path) -> None:
    src = texts(tmp_path)
    (tmp_path / "tok.py").write_text(PLUGIN)
    out = tmp_path / "t.zarr"
    args = ("build", src, "-o", out, "--preprocess", "tok.py:tokens", "--include", "*.txt")
    assert run_in(tmp_path, *args)[0] == 0
    (src / "t0.txt").unlink()  # only a removal: nothing new preprocessed, the rest carried into a new shard
    code, err = run_in(tmp_path, *args)
    assert code == 0 and "0 files preprocessed" in err and "5 of them carried" in err, err
    assert "samples/s written" in err  # carrying them was this run's work
    code, err = run_in(tmp_path, "verify", out)
    assert code == 0 and f"{out}: OK (" in err
    (tmp_path / "tok.py").write_text(PLUGIN.replace("return", "raise ValueError('no tokens')\n    return"))
    code, err = run_in(tmp_path, *args, "--strict", "--force")
    assert code == 1 and "was skipped (ValueError: no tokens); --strict (--max-errors 0) allows none" in err, err
    code, out_text = _preview_rows(tmp_path, out)  # the failed build changed nothing at OUTPUT
    assert code == 0 and out_text.splitlines()[0].split() == ["source", "tokens"], out_text
    assert "t1.txt" in out_text and "[2 2 2 2] (4,)" in out_text


def _preview_rows(folder: Path, dataset: Path) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [*BATCHCTL, "preview", str(dataset), "-o", str(folder / "p.png")],
        capture_output=True,
        text=True,
        cwd=folder,
        env=env,
        timeout=60,
    )
    return done.returncode, done.stdout


def test_help_reads_as_unix_help() -> None:
    script = str(Path(sys.executable).parent / "batchctl")
    env = {**os.environ, "COLUMNS": "100"}
    build_help = subprocess.run([script, "build", "--help"], capture_output=True, text=True, env=env).stdout
    assert "Usage: batchctl build [OPTIONS] SOURCE\n" in build_help
    assert "range>" not in build_help and "<str>" not in build_help and "<path>" not in build_help
    for choices in ("--layout <hwc|chw>", "--compression <auto|zstd|blosc|none>", "--engine <local|dask>"):
        assert choices in build_help
    assert "--batch-size N" in build_help and "--option KEY=VALUE" in build_help
    for command in ("info", "verify", "preview"):
        text = subprocess.run([script, command, "--help"], capture_output=True, text=True, env=env).stdout
        assert "Exit codes" in text and "failed build" not in text and "SIGTERM" not in text, command


def test_info_says_what_is_there(tmp_path: Path) -> None:
    src = texts(tmp_path)
    (tmp_path / "tok.py").write_text(PLUGIN)
    out = tmp_path / "t.zarr"
    assert run_in(tmp_path, "build", src, "-o", out, "--preprocess", "tok.py:tokens", "--include", "*.txt")[0] == 0
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    text = subprocess.run([*BATCHCTL, "info", str(out)], capture_output=True, text=True, env=env, cwd=ROOT).stdout
    assert "1 shard (up to " in text and " KiB on disk" in text and "0.0 MiB" not in text, text
    source_line = next(line for line in text.splitlines() if line.strip().startswith("source "))
    assert "uint8" in source_line and "UTF-8 paths, zero-padded" in source_line
    (tmp_path / "empty").mkdir()
    done = subprocess.run([*BATCHCTL, "info", str(tmp_path / "empty")], capture_output=True, text=True, env=env)
    assert done.returncode == 1 and "Error" not in done.stderr and "no batchctl dataset here" in done.stderr


def test_make_demo_installs_batchctl_alone_and_says_where_it_is(tmp_path: Path) -> None:
    """`make -n` (what make would run) for a fresh venv: the demo needs batchctl, not the dev set."""
    venv = tmp_path / "venv"
    demo = subprocess.run(["make", "-n", "demo", f"VENV={venv}"], capture_output=True, text=True, cwd=ROOT)
    assert demo.returncode == 0, demo.stderr
    assert "pip install -q -e .\n" in demo.stdout
    assert ".[dev]" not in demo.stdout and "torch" not in demo.stdout
    install = subprocess.run(["make", "-n", "install", f"VENV={venv}"], capture_output=True, text=True, cwd=ROOT)
    assert f"source {venv}/bin/activate" in install.stdout
    assert f"source {venv}/bin/activate" in demo.stdout  # the demo says how to reach batchctl next


def test_each_array_explains_itself_and_the_group_is_consolidated(tmp_path: Path) -> None:
    import warnings

    import zarr

    from batchctl.synthetic import make_image_folder

    make_image_folder(tmp_path / "imgs", 12, sides=(50, 60))
    out = tmp_path / "d.zarr"
    assert run_in(tmp_path, "build", "imgs", "-o", out, "--batch-size", "4", "--resize", "32", "--crop", "24")[0] == 0
    image = zarr.open_array(str(out / "image"), mode="r")  # one array alone, as tensorstore or dask open it
    assert image.metadata.dimension_names == ("sample", "height", "width", "channel")
    assert image.attrs["layout"] == "hwc"
    assert image.attrs["color_space"] == "RGB" and image.attrs["value_range"] == [0, 255]  # what the numbers mean
    assert zarr.open_array(str(out / "label"), mode="r").attrs["classes"] == ["cat", "dog", "fish"]
    assert zarr.open_array(str(out / "source"), mode="r").attrs["encoding"] == "UTF-8"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # what xarray's open_zarr does first: no fallback, no warning
        group = zarr.open_consolidated(str(out), mode="r")
    assert sorted(group.metadata.consolidated_metadata.metadata) == ["image", "label", "source", "source_index"]
    assert np.array_equal(group["label"][:], np.concatenate([b["label"] for b in batchctl.open(out)]))
    label_doc = out / "label" / "zarr.json"
    label_doc.write_text(label_doc.read_text().replace('"fish"', '"shark"'))  # the copy no longer matches
    code, err = run_in(tmp_path, "verify", out)
    assert code == 1 and "label: the group's consolidated metadata differs from label/zarr.json" in err


def test_the_record_travels_with_the_dataset(tmp_path: Path) -> None:
    src = texts(tmp_path, count=8)
    (tmp_path / "tok.py").write_text(PLUGIN)
    plugin = ("--preprocess", f"{tmp_path / 'tok.py'}:tokens", "--include", "*.txt")
    first = tmp_path / "first"
    first.mkdir()
    assert run_in(tmp_path, "build", src, "-o", first / "t.zarr", *plugin)[0] == 0
    assert set(os.listdir(first)) <= {"t.zarr", ".t.zarr.batchctl.lock"}  # beside OUTPUT: at most the lock
    moved = tmp_path / "elsewhere" / "t.zarr"
    moved.parent.mkdir()
    os.rename(first / "t.zarr", moved)  # the dataset moved (or copied) somewhere else
    (src / "t8.txt").write_text("y" * 9)
    code, err = run_in(tmp_path, "build", src, "-o", moved, *plugin)
    assert code == 0 and "building everything" not in err and "1 added" in err, err
    # a dataset an earlier batchctl published kept its record beside it: still used, then removed
    os.rename(moved / "batchctl.record", moved.parent / ".t.zarr.batchctl.record")
    (src / "t9.txt").write_text("z" * 10)
    code, err = run_in(tmp_path, "build", src, "-o", moved, *plugin)
    assert code == 0 and "building everything" not in err and "1 added" in err, err
    assert not (moved.parent / ".t.zarr.batchctl.record").exists() and (moved / "batchctl.record").is_file()
    assert sorted(np.concatenate([b["tokens"] for b in batchctl.open(moved)])[:, 0].tolist()) == list(range(1, 11))


def test_a_usage_error_leaves_no_lock_file(tmp_path: Path) -> None:
    code, err = run_in(tmp_path, "build", tmp_path / "typo_dir")
    assert code == 2 and "SOURCE" in err and "is not a folder" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no .typo_dir.zarr.batchctl.lock, nothing


def test_more_workers_than_cores_is_said_once_and_kept(tmp_path: Path) -> None:
    src = texts(tmp_path)
    (tmp_path / "tok.py").write_text(PLUGIN)
    cores = len(os.sched_getaffinity(0))
    args = ("--preprocess", "tok.py:tokens", "--include", "*.txt", "--workers", str(cores + 2))
    code, err = run_in(tmp_path, "build", src, "-o", tmp_path / "t.zarr", *args)
    assert code == 0, err
    said = [line for line in err.splitlines() if f"--workers {cores + 2}" in line]
    assert len(said) == 1 and f"{cores} cores" in said[0], err
    code, err = run_in(tmp_path, "build", src, "-o", tmp_path / "q.zarr", *args, "--quiet")
    assert code == 0 and err == "", err  # --quiet: errors only


def test_info_says_the_short_last_batch_and_why_a_loose_file_was_ignored(tmp_path: Path) -> None:
    from batchctl.synthetic import make_image_folder

    src = tmp_path / "photos"
    make_image_folder(src, 10, sides=(40, 60))
    loose = sorted((src / "cat").iterdir())[0]
    shutil.copy2(loose, src / "loose.jpg")  # beside the class folders
    out = tmp_path / "p.zarr"
    assert run_in(tmp_path, "build", src, "-o", out, "--batch-size", "4", "--resize", "32", "--crop", "32")[0] == 0
    text = subprocess.run([*BATCHCTL, "info", str(out)], capture_output=True, text=True, cwd=ROOT).stdout
    assert "3 batches of 4 (the last holds 2)" in text, text
    assert "loose.jpg (beside the class folders: it has no class)" in text, text


DESCRIBED = """
import numpy as np
from batchctl.preprocess import describes

@describes(tokens={"dimension_names": ["token"], "attributes": {"meaning": "file length, repeated", "units": "bytes"}})
def tokens(path, length=4):
    return {"tokens": np.full(length, len(path.read_bytes()), dtype=np.int32)}
"""


def test_a_plugin_names_its_dimensions_and_describes_its_fields(tmp_path: Path) -> None:
    import zarr

    src = texts(tmp_path)
    (tmp_path / "tok.py").write_text(DESCRIBED)
    out = tmp_path / "t.zarr"
    code, err = run_in(tmp_path, "build", src, "-o", out, "--preprocess", "tok.py:tokens", "--include", "*.txt")
    assert code == 0, err
    tokens = zarr.open_array(str(out / "tokens"), mode="r")  # opened alone, as tensorstore or xarray would
    assert tokens.metadata.dimension_names == ("sample", "token")
    assert tokens.attrs["meaning"] == "file length, repeated" and tokens.attrs["units"] == "bytes"
    (tmp_path / "bad.py").write_text(DESCRIBED.replace('["token"]', '"token"').replace("def tokens", "def bad"))
    code, err = run_in(tmp_path, "build", src, "-o", tmp_path / "b.zarr", "--preprocess", "bad.py:bad")
    assert code == 2 and "dimension_names must be a list of names" in err and err.count("\n") == 1, err


def quick_start() -> tuple[list[str], str]:
    """The README's quick start: its batchctl commands (after `make demo`, `cd demo`) and its Python."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("    batchctl ")]
    commands = [line.split("  #")[0].strip() for line in lines]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    return commands, code


def test_the_readmes_quick_start_runs_as_written_after_make_demo(tmp_path: Path) -> None:
    """`make demo` makes demo/photos (examples/make_images.py, 200 photos) and builds it as the
    quick start's first command does; from demo/, each command and the Python block run as written."""
    commands, code = quick_start()
    assert [c.split()[1] for c in commands] == ["build", "info", "verify", "preview"]
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert "examples/make_images.py demo/photos --count 200" in makefile
    assert "build demo/photos --batch-size 64" in makefile
    made = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "make_images.py"), "photos", "--count", "200"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    for command in commands:
        code_, err = run_in(tmp_path, *command.split()[1:])
        assert code_ == 0, (command, err)
    assert (tmp_path / "grid.png").stat().st_size > 0
    ran = subprocess.run(
        [sys.executable, "-c", code.replace("        ...", "        assert len(batch['label']) == 64")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
