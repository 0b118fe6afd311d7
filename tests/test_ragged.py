"""Ragged fields: rows whose first dimension varies, built by the real CLI, stored as
offsets and values (docs/format.md), read back exactly by batchctl, zarr-python and tensorstore."""

from __future__ import annotations

import json
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest

import batchctl
from batchctl.read.inspect import verify
from tests.conftest import kill_group, run_cli, start_cli, wait_group_gone

PLUGIN = "tests/plugins.py:ragged_tokens"


def write_docs(folder: Path, count: int, seed: int, start: int = 0) -> None:
    """Documents of 0 to 600 bytes (some empty: a row of no tokens), in two sub-folders' worth of names."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(start, start + count):
        size = 0 if i % 17 == 0 else int(rng.integers(1, 600))
        (folder / f"doc{i:04d}.txt").write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())


def expected_rows(folder: Path, source: str) -> tuple[np.ndarray, np.ndarray]:
    data = np.frombuffer((folder / source).read_bytes(), dtype=np.uint8)
    boxes = np.arange(len(data) % 5 * 4, dtype=np.float32).reshape(-1, 4) + len(data)
    return data.astype(np.int32), boxes


def build(folder: Path, out: Path, *extra: str) -> None:
    result = run_cli("build", folder, "-o", out, "--preprocess", PLUGIN, "--batch-size", "16", *extra)
    assert result.returncode == 0, result.stderr


def assert_rows_exact(folder: Path, sources: list[str], tokens: list[np.ndarray], boxes: list[np.ndarray]) -> None:
    for source, got_tokens, got_boxes in zip(sources, tokens, boxes, strict=True):
        want_tokens, want_boxes = expected_rows(folder, source)
        assert got_tokens.dtype == np.int32 and np.array_equal(got_tokens, want_tokens), source
        assert got_boxes.shape == want_boxes.shape and np.array_equal(got_boxes, want_boxes), source


def assert_dataset_is_the_folder(out: str | Path, folder: Path) -> None:
    """Every file of `folder` once in the dataset at `out`, its rows exact, every byte verified."""
    ds = batchctl.open(out)
    batches = [ds[i] for i in range(len(ds))]
    sources = [s for b in batches for s in b["source"]]
    assert sorted(sources) == sorted(p.name for p in folder.iterdir())
    tokens, boxes = [r for b in batches for r in b["tokens"]], [r for b in batches for r in b["boxes"]]
    assert_rows_exact(folder, sources, tokens, boxes)
    assert [str(p) for p in verify(out)] == []


@pytest.fixture(scope="module")
def docs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("docs") / "src"
    write_docs(folder, 150, seed=46)
    out = folder.parent / "docs.zarr"
    build(folder, out, "--shard-batches", "3")
    return folder, out


def test_ragged_rows_round_trip_through_batchctl_and_zarr(docs: tuple[Path, Path]) -> None:
    """Every file exactly once, its rows exactly (empty ones included), by `batchctl.open` and
    by zarr-python through the recipe docs/reading.md gives; the fields say which are ragged."""
    import zarr

    folder, out = docs
    ds = batchctl.open(out)
    assert ds.attrs.fields["tokens"] == {"shape": [None], "dtype": "int32"}
    assert ds.attrs.fields["boxes"] == {"shape": [None, 4], "dtype": "float32"}
    assert ds.fields["boxes"][0] == (-1, 4)
    sources = [s for i in range(len(ds)) for s in ds[i]["source"]]
    assert sorted(sources) == sorted(p.name for p in folder.iterdir())
    tokens = [row for i in range(len(ds)) for row in ds[i]["tokens"]]
    boxes = [row for i in range(len(ds)) for row in ds[i]["boxes"]]
    assert_rows_exact(folder, sources, tokens, boxes)
    assert any(len(row) == 0 for row in tokens)

    group = zarr.open_group(str(out), mode="r")
    batch_size = group.attrs["batchctl"]["batch_size"]
    offsets, values = group["tokens.offsets"], group["tokens.values"]
    source = [bytes(row).rstrip(b"\0").decode() for row in group["source"][:]]
    for i in range(0, len(source), 7):  # the recipe: sample i's values in its batch's row
        start, stop = offsets[i]
        want, _ = expected_rows(folder, source[i])
        assert np.array_equal(values[i // batch_size, start:stop], want)
    assert [str(p) for p in verify(out)] == []


def test_tensorstore_reads_ragged_rows_by_the_recipe(docs: tuple[Path, Path]) -> None:
    ts = pytest.importorskip("tensorstore")
    folder, out = docs

    def opened(name: str):  # type: ignore[no-untyped-def]
        return ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(out / name)}}).result()

    offsets, values, source = opened("boxes.offsets"), opened("boxes.values"), opened("source")
    assert values.domain.labels[0] == "batch" and offsets.domain.labels[0] == "sample"
    every = offsets.read().result()
    names = [bytes(row).rstrip(b"\0").decode() for row in source.read().result()]
    batch_size = batchctl.open(out).batch_size
    for i in range(0, len(names), 5):
        start, stop = (int(v) for v in every[i])
        _, want = expected_rows(folder, names[i])
        got = values[i // batch_size, start:stop].read().result()
        assert got.shape == want.shape and np.array_equal(got, want)


@pytest.mark.parametrize("mode", ["list", "pad"])
def test_loader_gives_lists_or_padded_rows_with_any_batch_size(docs: tuple[Path, Path], mode: str) -> None:
    folder, out = docs
    ds = batchctl.open(out)
    seen = []
    for batch in ds.loader(batch_size=12, mix=4, seed=3, ragged=mode, drop_last=False):
        if mode == "list":
            assert isinstance(batch["tokens"], list) and len(batch["tokens"]) == len(batch["source"])
            tokens, boxes = batch["tokens"], batch["boxes"]
        else:
            lengths, box_lengths = batch["tokens_lengths"], batch["boxes_lengths"]
            assert batch["tokens"].shape == (len(batch["source"]), lengths.max())
            assert all((row[n:] == 0).all() for row, n in zip(batch["tokens"], lengths, strict=True))
            tokens = [row[:n] for row, n in zip(batch["tokens"], lengths, strict=True)]
            boxes = [row[:n] for row, n in zip(batch["boxes"], box_lengths, strict=True)]
        assert_rows_exact(folder, list(batch["source"]), tokens, boxes)
        seen += list(batch["source"])
    assert sorted(seen) == sorted(p.name for p in folder.iterdir())


def test_ragged_rows_resume_exactly_on_another_world_size(docs: tuple[Path, Path]) -> None:
    """A state saved part way on 2 ranks resumes on 1 with the rows the 2 ranks would have read."""
    _, out = docs
    ds = batchctl.open(out)
    options = {"batch_size": 8, "mix": 4, "seed": 5, "partitions": 2}
    whole = [[list(map(list, b["tokens"])) for b in ds.loader(rank=r, world_size=2, **options)] for r in range(2)]
    first = ds.loader(rank=0, world_size=2, **options)
    iterator = iter(first)
    for _ in range(3):
        next(iterator)
    state = first.state_dict()
    resumed = ds.loader(world_size=1, **options)
    resumed.load_state_dict(state)
    rest = [list(map(list, b["tokens"])) for b in resumed]
    interleaved = [batch for pair in zip(whole[0], whole[1], strict=True) for batch in pair]
    assert rest == interleaved[6:]


@pytest.mark.parametrize("compression", ["auto", "none"])
def test_rebuilds_are_reproducible_and_incremental(tmp_path: Path, compression: str) -> None:
    """The same files give the same bytes whatever --workers; a grown folder is built
    incrementally (kept shards, the last one kept open, carried rows) into what a fresh build of
    the new folder reads as, row for row. Values zstd-compressed (`auto`: these bytes shrink) or raw."""
    folder = tmp_path / "src"
    write_docs(folder, 100, seed=7)
    one, two = tmp_path / "one.zarr", tmp_path / "two.zarr"
    build(folder, one, "--workers", "1", "--shard-batches", "2", "--compression", compression)
    build(folder, two, "--workers", "2", "--shard-batches", "2", "--compression", compression)
    codecs = {"auto": ["bytes", "zstd"], "none": ["bytes", "crc32c"]}[compression]
    values = json.loads((one / "tokens.values" / "zarr.json").read_text())["codecs"][0]["configuration"]["codecs"]
    assert [codec["name"] for codec in values] == codecs
    assert batchctl.open(one).build_id == batchctl.open(two).build_id
    write_docs(folder, 20, seed=8, start=100)  # added
    (folder / "doc0003.txt").write_bytes(b"changed")  # changed: its shard is rewritten, the rest kept
    report = tmp_path / "report.json"
    build(folder, one, "--workers", "2", "--shard-batches", "2", "--compression", compression, "--report", str(report))
    done = json.loads(report.read_text())
    assert done["added"]["count"] == 20 and done["changed"]["count"] == 1
    assert done["kept_samples"] > done["carried_samples"] > 0  # shards kept whole, rows carried from the rewritten one
    ds = batchctl.open(one)
    sources = [s for i in range(len(ds)) for s in ds[i]["source"]]
    assert sorted(sources) == sorted(p.name for p in folder.iterdir())
    assert_rows_exact(
        folder,
        sources,
        [row for i in range(len(ds)) for row in ds[i]["tokens"]],
        [row for i in range(len(ds)) for row in ds[i]["boxes"]],
    )
    assert [str(p) for p in verify(one)] == []


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_interrupted_ragged_builds_resume_to_every_row_exactly_once(tmp_path: Path, compression: str) -> None:
    """SIGINT, SIGTERM or SIGKILL at random moments (the first second included); each rerun
    resumes, and the dataset ends with every file once, its rows exact, the digest a fresh
    build's."""
    folder = tmp_path / "src"
    write_docs(folder, 120, seed=9)
    out, fresh = tmp_path / "data.zarr", tmp_path / "fresh.zarr"
    args = ["build", folder, "-o", out, "--preprocess", PLUGIN, "--batch-size", "16", "--shard-batches", "2"]
    args += ["--compression", compression]
    rng = random.Random(46)
    for _ in range(6):
        proc = start_cli(*args, "--option", "delay=0.03")
        time.sleep(rng.uniform(0.2, 1.5))
        kill_group(proc, rng.choice([signal.SIGINT, signal.SIGTERM, signal.SIGKILL]))
        _, stderr = proc.communicate(timeout=30)
        assert "Traceback" not in stderr, stderr
        assert wait_group_gone(proc.pid) == []
        if proc.returncode == 0:
            break
    result = run_cli(*args, "--option", "delay=0.03")
    assert result.returncode == 0, result.stderr
    build(folder, fresh, "--shard-batches", "2", "--option", "delay=0.03", "--compression", compression)
    ds = batchctl.open(out)
    sources = [s for i in range(len(ds)) for s in ds[i]["source"]]
    assert sorted(sources) == sorted(p.name for p in folder.iterdir())
    assert_rows_exact(
        folder,
        sources,
        [r for i in range(len(ds)) for r in ds[i]["tokens"]],
        [r for i in range(len(ds)) for r in ds[i]["boxes"]],
    )
    assert ds.build_id == batchctl.open(fresh).build_id
    assert [str(p) for p in verify(out)] == []


def test_a_row_of_another_dtype_is_one_skipped_file(tmp_path: Path) -> None:
    folder = tmp_path / "src"
    write_docs(folder, 20, seed=10)
    (folder / "wrong.txt").write_bytes(b"abc")
    out, report = tmp_path / "d.zarr", tmp_path / "r.json"
    build(folder, out, "--report", str(report))
    skipped = json.loads(report.read_text())["errors"]
    assert [entry["source"] for entry in skipped] == ["wrong.txt"]
    assert "field 'tokens' is (n,) int64, the dataset's is (n,) int32" in skipped[0]["error"]
    assert batchctl.open(out).num_samples == 20


def test_damaged_values_are_found_by_verify_and_refused_by_readers(docs: tuple[Path, Path], tmp_path: Path) -> None:
    import shutil

    _, out = docs
    copy = tmp_path / "copy.zarr"
    shutil.copytree(out, copy)
    shard = copy / "tokens.values" / "c" / "0" / "0"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF  # inside batch 0's first chunk
    shard.write_bytes(bytes(data))
    problems = [str(p) for p in verify(copy)]
    assert any("tokens batch 0" in p and "checksum" in p for p in problems), problems
    with pytest.raises(batchctl.FormatError, match="checksum"):
        batchctl.open(copy)[0]


def test_torch_streams_ragged_rows_as_nested_or_padded_tensors(docs: tuple[Path, Path]) -> None:
    """`IterableBatches` through a DataLoader with 2 workers: each ragged field one jagged nested
    tensor (or padded, with lengths), every row exact and every file once."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from batchctl.torch import IterableBatches

    folder, out = docs
    for mode in ("list", "pad"):
        stream = IterableBatches(out, batch_size=10, mix=2, drop_last=False, ragged=mode)
        seen = []
        for batch in DataLoader(stream, batch_size=None, num_workers=2):
            if mode == "list":
                assert batch["tokens"].is_nested and batch["tokens"].layout == torch.jagged
                tokens = [row.numpy() for row in batch["tokens"].unbind()]
                boxes = [row.numpy() for row in batch["boxes"].unbind()]
            else:
                lengths, box_lengths = batch["tokens_lengths"].tolist(), batch["boxes_lengths"].tolist()
                tokens = [row[:n].numpy() for row, n in zip(batch["tokens"], lengths, strict=True)]
                boxes = [row[:n].numpy() for row, n in zip(batch["boxes"], box_lengths, strict=True)]
            assert_rows_exact(folder, batch["source"], tokens, boxes)
            seen += batch["source"]
        assert set(seen) == {p.name for p in folder.iterdir()}  # (drop_last=False: a short share repeats a batch)


def test_a_mixture_of_ragged_datasets_keeps_each_row_exact(docs: tuple[Path, Path], tmp_path: Path) -> None:
    folder, out = docs
    other_folder = tmp_path / "other"
    write_docs(other_folder, 60, seed=12)
    other = tmp_path / "other.zarr"
    build(other_folder, other)
    mixture = batchctl.mix({"a": out, "b": other}, {"a": 3, "b": 1}, batch_size=8, seed=1)
    for batch in mixture:
        for row, (source, which) in enumerate(zip(batch["source"], batch["dataset"], strict=True)):
            want, _ = expected_rows(folder if which == 0 else other_folder, source)
            assert np.array_equal(batch["tokens"][row], want)


def test_shards_of_empty_rows_only(tmp_path: Path) -> None:
    """A shard whose batches hold no values at all (every row empty) is an index alone: it reads,
    verifies and keeps its digest."""
    folder = tmp_path / "src"
    folder.mkdir()
    for i in range(10):
        (folder / f"empty{i}.txt").write_bytes(b"")
    out = tmp_path / "empty.zarr"
    build(folder, out, "--batch-size", "4", "--shard-batches", "1")
    ds = batchctl.open(out)
    assert all(len(row) == 0 for i in range(len(ds)) for row in ds[i]["tokens"])
    assert sum(len(ds[i]["tokens"]) for i in range(len(ds))) == 10
    assert [str(p) for p in verify(out)] == []
