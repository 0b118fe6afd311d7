"""Audio, .npy/.npz, user plugins and big-file splitting: exact values and exactly-once
(`source`, `source_index`) in every case."""

from __future__ import annotations

import json
import math
import os
import wave
from pathlib import Path

import numpy as np
import pytest

import batchctl
from tests.conftest import PLUGINS, ROOT, run_cli


def write_wav(path: Path, rate: int, samples: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1 if samples.ndim == 1 else samples.shape[1])
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(samples.astype("<i2").tobytes())


def rows_by_key(out: Path, field: str) -> dict[tuple[str, int], np.ndarray]:
    ds = batchctl.open(out)
    rows = {}
    for batch in ds:
        for source, index, value in zip(batch["source"], batch["source_index"], batch[field], strict=True):
            key = (str(source), int(index))
            assert key not in rows, f"{key} appears twice"
            rows[key] = value
    return rows


def test_audio_clips_exact_values_and_counts(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    speech = rng.integers(-20000, 20000, 16000 * 2 + 5000)  # 2.3125 s -> 3 clips
    write_wav(tmp_path / "src" / "yes" / "a.wav", 16000, speech)
    stereo = rng.integers(-20000, 20000, (8000, 2))  # 0.5 s -> 1 clip, channels averaged
    write_wav(tmp_path / "src" / "no" / "b.wav", 16000, stereo)
    tone = (np.sin(np.arange(44100 * 3 // 2) * 2 * np.pi * 440 / 44100) * 10000).astype(int)  # 1.5 s at 44.1 kHz
    write_wav(tmp_path / "src" / "no" / "c.wav", 44100, tone)
    out = tmp_path / "audio.zarr"
    result = run_cli("build", tmp_path / "src", "-o", out, "--preprocess", "audio", "--batch-size", "2", "--strict")
    assert result.returncode == 0, result.stderr
    ds = batchctl.open(out)
    assert ds.classes == ["no", "yes"] and ds.fields["audio"] == ((16000,), np.dtype("float32"))
    rows = rows_by_key(out, "audio")
    assert set(rows) == {
        ("yes/a.wav", 0),
        ("yes/a.wav", 1),
        ("yes/a.wav", 2),
        ("no/b.wav", 0),
        ("no/c.wav", 0),
        ("no/c.wav", 1),
    }
    expected = np.zeros(3 * 16000, np.float32)
    expected[: len(speech)] = speech / 32768
    for i in range(3):
        np.testing.assert_array_equal(rows[("yes/a.wav", i)], expected[i * 16000 : (i + 1) * 16000])
    mono = (stereo[:, 0] / 32768 + stereo[:, 1] / 32768) / 2
    np.testing.assert_allclose(rows[("no/b.wav", 0)][:8000], mono, atol=1e-6)
    assert not rows[("no/b.wav", 0)][8000:].any()
    # resampled 44.1k -> 16k: still a 440 Hz tone of the same amplitude, zero-padded after 1.5 s
    first = rows[("no/c.wav", 0)]
    spectrum = np.abs(np.fft.rfft(first))
    assert abs(int(np.argmax(spectrum)) - 440) <= 1
    assert 0.28 < float(np.abs(first[1000:15000]).max()) < 0.33
    assert not rows[("no/c.wav", 1)][8100:].any()


def test_npy_and_npz_keep_dtype_and_values(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    arrays = {f"a{i}.npy": np.arange(12, dtype=np.int16).reshape(3, 4) * i for i in range(5)}
    for name, array in arrays.items():
        np.save(src / name, array)
    np.savez(src / "pair.npz", x=np.ones((3, 4), np.int16), y=np.zeros(2))
    out = tmp_path / "npy.zarr"
    result = run_cli("build", src, "-o", out, "--preprocess", "npy", "--key", "x")
    assert result.returncode == 0, result.stderr
    rows = rows_by_key(out, "array")
    assert set(rows) == {(name, 0) for name in arrays} | {("pair.npz", 0)}
    for name, array in arrays.items():
        assert rows[(name, 0)].dtype == np.int16 and np.array_equal(rows[(name, 0)], array)
    assert np.array_equal(rows[("pair.npz", 0)], np.ones((3, 4), np.int16))
    no_key = run_cli("build", src, "-o", tmp_path / "nokey.zarr", "--preprocess", "npy")
    assert "skipped pair.npz: KeyError" in no_key.stderr and "choose one with --key" in no_key.stderr


def test_big_npy_is_split_into_parts_and_every_row_lands_once(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    big = np.arange(70_000 * 64, dtype=np.float32).reshape(70_000, 64)  # 17.9 MB: two parts
    np.save(src / "big.npy", big)
    np.save(src / "small.npy", np.arange(6, dtype=np.float32).reshape(3, 2).repeat(32, axis=1))
    out, report = tmp_path / "rows.zarr", tmp_path / "r.json"
    result = run_cli(
        "build",
        src,
        "-o",
        out,
        "--preprocess",
        "npy",
        "--split-rows",
        "--batch-size",
        "1000",
        "--report",
        report,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    ds = batchctl.open(out)
    assert ds.num_samples == 70_003
    sources = np.concatenate([b["source"] for b in ds])
    index = np.concatenate([b["source_index"] for b in ds])
    values = np.concatenate([b["array"] for b in ds])
    is_big = sources == "big.npy"
    order = np.argsort(index[is_big])
    assert np.array_equal(index[is_big][order], np.arange(70_000))
    assert np.array_equal(values[is_big][order], big)
    assert sorted(index[~is_big].tolist()) == [0, 1, 2]
    assert json.loads(report.read_text())["processed"] == 2  # files, though big.npy went as parts


def test_plugin_module_and_file_with_a_failing_file(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("one.bin", "two.bin", "bad.bin"):
        (src / name).write_bytes(bytes(range(len(name), len(name) + 10)))
    for spec in ("tests.plugins:raises_for_bad", f"{ROOT / 'tests' / 'plugins.py'}:raises_for_bad"):
        out, report = tmp_path / f"{len(spec)}.zarr", tmp_path / "r.json"
        result = run_cli("build", src, "-o", out, "--preprocess", spec, "--report", report)
        assert result.returncode == 0, result.stderr
        assert "skipped bad.bin: ValueError: bad.bin is marked bad" in result.stderr
        ds = batchctl.open(out)
        assert set(ds.fields) == {"vec", "length", "source", "source_index"}
        rows = {str(s): (v, n) for b in ds for s, v, n in zip(b["source"], b["vec"], b["length"], strict=True)}
        assert set(rows) == {"one.bin", "two.bin"}
        np.testing.assert_array_equal(rows["one.bin"][0], np.arange(7, 15, dtype=np.float32))
        assert rows["two.bin"][1] == 10


def test_workers_run_one_blas_thread_unless_the_user_says(tmp_path: Path) -> None:
    """A build runs a process per core: BLAS and OpenMP get one thread each in the workers, unless
    the user set a number; a build called from Python leaves the caller's environment as it was."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("a.bin", "b.bin"):
        (src / name).write_bytes(b"x")
    names = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
    unset = {key: value for key, value in os.environ.items() if key not in names}
    plugin = ["--preprocess", "tests.plugins:library_threads", "--quiet"]
    for env, expected in [(unset, [1, 1, 1]), ({**unset, "OMP_NUM_THREADS": "4"}, [1, 4, 1])]:
        out = tmp_path / f"cli{expected[1]}.zarr"
        result = run_cli("build", src, "-o", out, *plugin, env=env)
        assert result.returncode == 0, result.stderr
        assert [row.tolist() for batch in batchctl.open(out) for row in batch["threads"]] == [expected] * 2
    before = dict(os.environ)
    batchctl.build(src, tmp_path / "api.zarr", preprocess="tests.plugins:library_threads")
    assert dict(os.environ) == before
    rows = [row.tolist() for batch in batchctl.open(tmp_path / "api.zarr") for row in batch["threads"]]
    assert rows == [[int(os.environ.get(name, "1")) for name in names]] * 2


def test_plugin_whose_shape_changes_for_one_file(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("a.bin", "b.bin", "c.bin", "odd.bin"):
        (src / name).write_bytes(b"x")
    out = tmp_path / "o.zarr"
    result = run_cli("build", src, "-o", out, "--preprocess", "tests.plugins:shape_changes", "--workers", "1")
    assert result.returncode == 0, result.stderr
    assert "skipped odd.bin: field 'vec' is (5,) int32, the dataset's is (4,) int32" in result.stderr
    rows = rows_by_key(out, "vec")
    assert set(rows) == {("a.bin", 0), ("b.bin", 0), ("c.bin", 0)}
    assert all(np.array_equal(v, np.full(4, 5, np.int32)) for v in rows.values())


def test_example_text_windows_plugin(tmp_path: Path) -> None:
    src = tmp_path / "corpus"
    src.mkdir()
    texts = {"a.txt": "hello world, " * 20, "b.txt": "ünïcödé"}
    for name, text in texts.items():
        (src / name).write_text(text, encoding="utf-8")
    (src / "skip.md").write_text("not included")
    out = tmp_path / "corpus.zarr"
    result = run_cli(
        "build",
        src,
        "-o",
        out,
        "--preprocess",
        "examples/text_windows.py:byte_windows",
        "--include",
        "*.txt",
        "--option",
        "window=16",
    )
    assert result.returncode == 0, result.stderr
    rows = rows_by_key(out, "tokens")
    for name, text in texts.items():
        data = text.encode()
        windows = math.ceil(len(data) / 16)
        assert {i for (s, i) in rows if s == name} == set(range(windows))
        joined = b"".join(rows[(name, i)].tobytes() for i in range(windows))
        assert joined[: len(data)] == data and not joined[len(data) :].strip(b"\0")
    assert not any(s == "skip.md" for s, _ in rows)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--preprocess", "tests.plugins:nothing_here"], "has no function 'nothing_here'"),
        (["--preprocess", "tests/plugins.py:np"], "not a function"),
        (["--preprocess", "missing_file.py:fn"], "no such file"),
        (["--layout", "cwh"], "--layout': 'cwh' is not one of 'hwc', 'chw'"),
        (["--preprocess", "audio", "--crop", "3"], "takes options"),
    ],
)
def test_bad_preprocessor_specs_are_usage_errors(tmp_path: Path, args: list[str], needle: str) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "x.png").write_bytes(b"")
    result = run_cli("build", tmp_path / "src", "-o", tmp_path / "o.zarr", *args)
    assert result.returncode == 2 and needle in result.stderr, result.stderr


def test_chw_layout(tmp_path: Path, image_folder: Path) -> None:
    out = tmp_path / "chw.zarr"
    result = run_cli("build", image_folder / "cat", "-o", out, "--layout", "chw", "--crop", "16", "--resize", "20")
    assert result.returncode == 0, result.stderr
    hwc = tmp_path / "hwc.zarr"
    assert (
        run_cli("build", image_folder / "cat", "-o", hwc, "--crop", "16", "--resize", "20", "--workers", "1").returncode
        == 0
    )
    a = {str(s): img for b in batchctl.open(out) for s, img in zip(b["source"], b["image"], strict=True)}
    b = {str(s): img for b2 in batchctl.open(hwc) for s, img in zip(b2["source"], b2["image"], strict=True)}
    assert all(np.array_equal(a[k], b[k].transpose(2, 0, 1)) for k in b)


def test_split_file_interrupted_and_resumed_lands_every_row_once(tmp_path: Path) -> None:
    import signal

    from tests.conftest import kill_group, start_cli, wait_for
    from tests.test_faults import journal_shards

    src = tmp_path / "src"
    src.mkdir()
    big = np.arange(140_000 * 32, dtype=np.float32).reshape(140_000, 32)  # 17.9 MB: two parts
    np.save(src / "big.npy", big)
    out = tmp_path / "rows.zarr"
    args = [
        "build",
        src,
        "-o",
        out,
        "--preprocess",
        "npy",
        "--split-rows",
        "--batch-size",
        "500",
        "--shard-batches",
        "2",
        "--workers",
        "2",
    ]
    proc = start_cli(*args)
    wait_for(lambda: journal_shards(out) >= 3 or proc.poll() is not None)
    kill_group(proc, signal.SIGKILL)
    proc.communicate(timeout=30)
    result = run_cli(*args, timeout=300)
    assert result.returncode == 0, result.stderr
    ds = batchctl.open(out)
    index = np.concatenate([b["source_index"] for b in ds])
    values = np.concatenate([b["array"] for b in ds])
    order = np.argsort(index)
    assert np.array_equal(index[order], np.arange(140_000))
    assert np.array_equal(values[order], big)


@pytest.mark.parametrize(
    ("plugin", "said"),
    [
        ("reserved_name", "returned the field 'label', a name batchctl keeps for itself"),
        ("text_field", "returned the field 'caption' as text ('a dog'): a field holds numbers; return the text as"),
        ("dict_field", "returned the field 'objects' as a dict: a field holds numbers; return each of its entries"),
        ("ragged_named", "returned the field 'x.offsets', named as batchctl names a ragged field's arrays"),
    ],
)
def test_a_field_no_dataset_holds_stops_the_build_at_the_first_file_in_one_line(
    tmp_path: Path, plugin: str, said: str
) -> None:
    """The preprocessor's fault, not a file's: one usage error (exit 2), not a skip per file, nor
    the collator's crash on a str dtype, nor a traceback; the fixed preprocessor's rerun starts over."""
    (tmp_path / "src").mkdir()
    for n in range(40):
        (tmp_path / "src" / f"{n:02d}.bin").write_bytes(b"x")
    out = tmp_path / "o.zarr"
    result = run_cli("build", tmp_path / "src", "-o", out, "--preprocess", f"tests.plugins:{plugin}", "--workers", "2")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0] and lines[0].startswith("batchctl: error: preprocessor tests.plugins")
    assert not out.exists()
    fixed = run_cli("build", tmp_path / "src", "-o", out, "--preprocess", "tests.plugins:constant_field")
    assert fixed.returncode == 0, fixed.stderr
    assert "starting over" in fixed.stderr and batchctl.open(out).num_samples == 40


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=">i4").reshape(3, 4),
        np.asfortranarray(np.ones((3, 5))),
        np.array(3.5),
        np.zeros((0, 2), np.float16),
        np.array([(1, 2.0)], dtype=[("a", "i2"), ("b", "f8")]),
    ],
)
def test_small_npy_reader_matches_np_load(array: np.ndarray) -> None:
    import io

    from batchctl.preprocess.npy import read_small_npy

    buffer = io.BytesIO()
    np.save(buffer, array)
    got = read_small_npy(buffer.getvalue())
    assert got.dtype == array.dtype and got.shape == array.shape and np.array_equal(got, array)
    with pytest.raises(ValueError):
        read_small_npy(buffer.getvalue()[: -max(1, array.nbytes // 2)] if array.nbytes else b"junk")


def test_a_build_where_most_files_are_skipped_fails_unless_given_a_budget(tmp_path: Path) -> None:
    src, out = tmp_path / "docs", tmp_path / "docs.zarr"
    src.mkdir()
    for n in range(40):
        (src / f"d{n:02d}.txt").write_text("word " * (10 + n))  # 40 lengths: one fixes the shape, 39 do not fit
    plugin = ["--preprocess", f"{PLUGINS}:tokens", "--workers", "2", "--batch-size", "4"]
    result = run_cli("build", src, "-o", out, *plugin)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    error = [line for line in result.stderr.splitlines() if line.startswith("batchctl: error:")]
    assert len(error) == 1 and "most files were skipped" in error[0] and "--max-errors" in error[0], error
    assert "field 'tokens'" in error[0] and not out.exists()
    allowed = run_cli("build", src, "-o", out, *plugin, "--max-errors", "100")
    assert allowed.returncode == 0, allowed.stderr  # the budget the user asked for
    assert batchctl.open(out).num_samples == 1
