"""Reading built datasets: the NumPy reader, info/verify/preview, adapters and a second Zarr."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import batchctl
from batchctl.read.inspect import verify
from batchctl.store import format as fmt
from tests.conftest import run_cli


@pytest.fixture(scope="module")
def dataset(image_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("read") / "data.zarr"
    result = run_cli(
        "build", image_folder, "-o", out, "--batch-size", "7", "--shard-batches", "2", "--crop", "24", "--resize", "32"
    )
    assert result.returncode == 0, result.stderr
    return out


def test_dataset_shape_and_batches(dataset: Path) -> None:
    ds = batchctl.open(dataset)
    assert (ds.num_samples, ds.num_batches, ds.batch_size, len(ds)) == (60, 9, 7, 9)
    assert ds.classes == ["cat", "dog", "fish"]
    assert ds.fields["image"] == ((24, 24, 3), np.dtype("uint8"))
    assert set(ds.fields) == {"image", "label", "source", "source_index"}
    last = ds[8]
    assert last["image"].shape == (4, 24, 24, 3) and len(last["source"]) == 4
    assert ds[-1]["source"].tolist() == last["source"].tolist()
    with pytest.raises(IndexError):
        ds[9]
    row = ds.sample(10)
    assert np.array_equal(row["image"], ds[1]["image"][3]) and row["source"] == ds[1]["source"][3]


def test_incomplete_dataset_is_refused_with_advice(dataset: Path, tmp_path: Path) -> None:
    import shutil

    import zarr

    partial = tmp_path / "partial.zarr"
    shutil.copytree(dataset, partial)
    group = zarr.open_group(str(partial), mode="r+")
    attrs = dict(group.attrs["batchctl"])
    attrs["complete"] = False
    group.attrs["batchctl"] = attrs
    with pytest.raises(batchctl.IncompleteDatasetError, match="rerun `batchctl build`"):
        batchctl.open(partial)
    assert isinstance(batchctl.IncompleteDatasetError("x"), batchctl.BatchctlError)
    assert batchctl.open(partial, allow_partial=True).num_samples == 60
    with pytest.raises(batchctl.FormatError):
        batchctl.open(tmp_path / "nothing-here")


def test_info_json(dataset: Path) -> None:
    result = run_cli("info", dataset, "--json")
    assert result.returncode == 0
    data = json.loads(result.stdout)
    assert (data["num_samples"], data["num_batches"], data["batch_size"], data["complete"]) == (60, 9, 7, True)
    assert data["classes"] == ["cat", "dog", "fish"] and data["class_counts"] == {"cat": 20, "dog": 20, "fish": 20}
    assert data["fields"]["image"]["shape"] == [24, 24, 3] and data["bytes"] > 0
    text = run_cli("info", dataset)
    assert text.returncode == 0 and "60 samples" in text.stdout and "cat 20" in text.stdout


def test_verify_passes_then_catches_zeroed_bytes_in_any_shard(dataset: Path, tmp_path: Path) -> None:
    import shutil

    assert run_cli("verify", dataset).returncode == 0
    for array in ("image", "source", "label", "source_index"):
        for shard in ("0", "4"):
            broken = tmp_path / f"{array}{shard}.zarr"
            shutil.copytree(dataset, broken)
            path = (
                next(p for p in (broken / array / "c" / shard).rglob("*") if p.is_file())
                if (broken / array / "c" / shard).is_dir()
                else broken / array / "c" / shard
            )
            data = bytearray(path.read_bytes())
            middle = len(data) // 2
            data[middle : middle + 4] = b"\0\0\0\0" if data[middle : middle + 4] != b"\0\0\0\0" else b"\1\1\1\1"
            path.write_bytes(bytes(data))
            problems = verify(broken)
            assert problems, (array, shard)
            result = run_cli("verify", broken)
            named = f"{array} batch" in result.stderr or f"{array} shard {shard}" in result.stderr  # chunk or index
            assert result.returncode == 1 and named, (array, shard, result.stderr)
    missing = tmp_path / "missing.zarr"
    shutil.copytree(dataset, missing)
    (missing / "label" / "c" / "1").unlink()
    result = run_cli("verify", missing)
    assert result.returncode == 1 and "label shard 1: shard file is missing" in result.stderr


def test_verify_checks_the_build_info_and_the_record(dataset: Path, tmp_path: Path) -> None:
    """No reader reads them, but the next build trusts them: one byte changed in the record, or in
    the build info's digest, shard hashes or record hash, is found and named, as is one gone."""
    import shutil

    info_name, record_name = "batchctl.build.json", "batchctl.record"
    info_bytes, record = (dataset / info_name).read_bytes(), (dataset / record_name).read_bytes()
    info = json.loads(info_bytes)
    shard_hash = sorted(info["shards"].values())[3].split(":")[-1]

    def flip_hex(value: str) -> bytes:
        flipped = value[:10] + ("0" if value[10] != "0" else "1") + value[11:]
        return info_bytes.replace(value.encode(), flipped.encode())

    def flip_bit(at: int) -> bytes:
        return record[:at] + bytes([record[at] ^ 1]) + record[at + 1 :]

    # (the file changed, its new bytes or None to remove it, the file the problem names)
    cases: list[tuple[str, bytes | None, str]] = [
        (info_name, flip_hex(info["digest"]), info_name),
        (info_name, flip_hex(shard_hash), info_name),
        (info_name, flip_hex(info["record_sha256"]), record_name),  # the two disagree: the record is not vouched for
        *((record_name, flip_bit(at), record_name) for at in (0, len(record) // 3, len(record) - 2)),
        (info_name, None, info_name),
        (record_name, None, record_name),
    ]
    for n, (changed, new, named) in enumerate(cases):
        copy = tmp_path / f"{n}.zarr"
        shutil.copytree(dataset, copy)
        if new is None:
            (copy / changed).unlink()
        else:
            (copy / changed).write_bytes(new)
        result = run_cli("verify", copy)
        assert result.returncode == 1 and f"{named}: " in result.stderr, (n, result.stderr)
        assert "Traceback" not in result.stderr


def test_preview_draws_a_grid(dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "grid.png"
    result = run_cli("preview", dataset, "-o", out, "--batch", "2", "--count", "6")
    assert result.returncode == 0, result.stderr
    with Image.open(out) as img:
        assert img.size == (3 * 160, 2 * 176)
        assert len(set(map(tuple, np.asarray(img).reshape(-1, 3)[::97].tolist()))) > 50  # pictures, not a blank sheet


@pytest.mark.parametrize("compression", ["auto", "zstd", "blosc", "none"])
def test_tensorstore_opens_every_array_bit_exact(image_folder: Path, tmp_path: Path, compression: str) -> None:
    """What the README claims: every array of the group opens in tensorstore (core Zarr v3 types
    only), reads what batchctl reads, and the `source` bytes decode to the same paths."""
    ts = pytest.importorskip("tensorstore")
    import zarr

    out = tmp_path / "d.zarr"
    args = ["--batch-size", "8", "--shard-batches", "3", "--crop", "16", "--resize", "16", "--compression", compression]
    assert run_cli("build", image_folder, "-o", out, *args).returncode == 0
    ds = batchctl.open(out)
    names = sorted(zarr.open_group(str(out), mode="r").array_keys())
    assert names == ["image", "label", "source", "source_index"]
    for name in names:
        store = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(out / name)}}).result()
        assert store.domain.labels[0] == "sample"
        got = store.read().result()
        ours = np.concatenate([ds[i][name] for i in range(len(ds))])
        if name == "source":
            assert got.dtype == np.uint8 and store.domain.labels[1] == "source_byte"
            assert [bytes(row).rstrip(b"\0").decode() for row in got] == ours.tolist()
        else:
            assert got.dtype == ours.dtype and np.array_equal(got, ours), name


def test_torch_adapters(dataset: Path) -> None:
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from batchctl.torch import BatchDataset, IterableBatches

    loader = DataLoader(BatchDataset(dataset), batch_size=None, num_workers=2)
    batches = list(loader)
    assert len(batches) == 9 and batches[0]["image"].shape == (7, 24, 24, 3)
    assert sorted(s for b in batches for s in b["source"]) == sorted(
        str(s) for b in batchctl.open(dataset) for s in b["source"]
    )
    iterable = IterableBatches(dataset, shuffle=True, seed=3, drop_last=False)
    iterable.set_epoch(1)
    seen = [s for b in DataLoader(iterable, batch_size=None, num_workers=2) for s in b["source"]]
    # 2 partitions (one per DataLoader worker): every row once (drop_last=False pads only across ranks)
    assert sorted(seen) == sorted(str(s) for b in batchctl.open(dataset) for s in b["source"])
    assert len(seen) == 60


@pytest.mark.parametrize("compression", ["zstd", "blosc", "none"])
def test_fast_chunk_reader_matches_zarr_and_catches_corruption(
    image_folder: Path, tmp_path: Path, compression: str
) -> None:
    import zarr

    out = tmp_path / "d.zarr"
    result = run_cli(
        "build",
        image_folder,
        "-o",
        out,
        "--batch-size",
        "8",
        "--shard-batches",
        "3",
        "--crop",
        "16",
        "--resize",
        "20",
        "--compression",
        compression,
    )
    assert result.returncode == 0, result.stderr
    ds = batchctl.open(out)
    assert all(reader is not None for reader in ds._fast.values())  # every array takes the fast path
    group = zarr.open_group(str(out), mode="r")
    for i in range(len(ds)):
        batch = ds[i]
        for name in group.array_keys():
            expected = group[name][i * 8 : (i + 1) * 8]
            if name == "source":
                expected = fmt.decode_sources(expected)
            assert batch[name].dtype == expected.dtype and np.array_equal(batch[name], expected), (name, i)
            assert batch[name].flags.writeable
    shard = out / "image" / "c" / "1" / "0" / "0" / "0"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3 : len(data) // 3 + 8] = bytes(8)
    shard.write_bytes(bytes(data))
    with pytest.raises(batchctl.BatchctlError):
        for j in range(3, 6):
            batchctl.open(out)[j]
