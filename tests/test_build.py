"""`batchctl build` end to end: the real CLI in a subprocess on generated image folders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from PIL import Image

import batchctl
from batchctl.store import format as fmt, metadata
from tests.conftest import run_cli
from tests.reference import mean_abs_diff, torchvision_reference


def image_files(root: Path) -> set[str]:
    rels = (p.relative_to(root).as_posix() for p in root.rglob("*") if p.suffix in (".jpg", ".png"))
    return {rel for rel in rels if not any(part.startswith(".") for part in rel.split("/"))}


@pytest.fixture(scope="module")
def built(image_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, object]:
    out = tmp_path_factory.mktemp("out") / "data.zarr"
    report = out.parent / "report.json"
    result = run_cli(
        "build",
        image_folder,
        "-o",
        out,
        "--batch-size",
        "8",
        "--shard-batches",
        "2",
        "--workers",
        "2",
        "--report",
        report,
    )
    assert result.returncode == 0, result.stderr
    return out, report, result


def test_every_input_appears_exactly_once_with_its_label(built: tuple, image_folder: Path) -> None:
    out, _, _ = built
    group = zarr.open_group(str(out), mode="r")
    sources = list(fmt.decode_sources(group["source"][:]))
    assert sorted(sources) == sorted(image_files(image_folder))
    classes = group.attrs["batchctl"]["classes"]
    assert classes == ["cat", "dog", "fish"]
    labels = group["label"][:]
    assert [classes[label] for label in labels] == [s.split("/")[0] for s in sources]
    assert list(group["source_index"][:]) == [0] * len(sources)


def test_rows_match_the_torchvision_reference(built: tuple, image_folder: Path) -> None:
    out, _, _ = built
    group = zarr.open_group(str(out), mode="r")
    images, sources = group["image"][:], fmt.decode_sources(group["source"][:])
    assert images.shape == (60, 224, 224, 3) and images.dtype == np.uint8
    for row, source in zip(images, sources, strict=True):
        assert mean_abs_diff(row, torchvision_reference(image_folder / source)) <= 3.0, source


def test_chunks_are_batches_and_shards_group_them(built: tuple) -> None:
    out, _, _ = built
    group = zarr.open_group(str(out), mode="r")
    for name in ("image", "label", "source", "source_index"):
        arr = group[name]
        assert arr.shape[0] == 60
        assert arr.chunks[0] == 8 and arr.shards[0] == 16, name
    shard_files = sorted(p.name for p in (out / "image" / "c").iterdir())
    assert shard_files == ["0", "1", "2", "3"]  # 60 rows / 16 per shard, the last one partial


def test_metadata_records_the_build(built: tuple) -> None:
    out, _, _ = built
    attrs = zarr.open_group(str(out), mode="r").attrs["batchctl"]
    assert attrs["complete"] is True
    assert attrs["format_version"] == 3
    assert (attrs["num_samples"], attrs["batch_size"], attrs["num_batches"], attrs["num_shards"]) == (60, 8, 8, 4)
    assert attrs["preprocess"] == {
        "name": "image",
        "options": {"resize": 256, "crop": 224, "layout": "hwc", "draft": True},
        "code": "image/1",
    }
    assert attrs["errors"] == 0 and attrs["ignored"] == 0
    assert attrs["fields"] == {"image": {"shape": [224, 224, 3], "dtype": "uint8"}}
    # the build's own facts lie beside the documents, not in them
    assert not {"created", "source", "build_id", "fingerprint", "batchctl_version"} & set(attrs)
    build = json.loads((out / "batchctl.build.json").read_text())
    assert build["batchctl_version"] == batchctl.__version__ and build["digest"] == attrs["digest"]
    assert len(attrs["digest"]) == 64 and "created" not in build


def test_report_and_summary(built: tuple) -> None:
    _, report_path, result = built
    report = json.loads(report_path.read_text())
    assert report["status"] == "complete"
    assert (report["samples"], report["processed"], report["errors"]) == (60, 60, [])
    assert report["ignored"] == {"count": 0, "paths": []}
    assert report["elapsed_s"] > 0 and report["samples_per_s"] > 0
    timings = report["timings"]  # where the time went: the stages add up to the build, within it
    stages = ("start_s", "preprocess_s", "finish_s", "publish_s")
    starting = ("discover_s", "plan_s", "pool_s")  # the start's own stages, and the command's before the build
    assert set(timings) == {*stages, *starting, "before_build_s", "fsync_s", "writer_wait_s"}
    assert all(timings[s] >= 0 for s in timings) and timings["before_build_s"] > 0
    assert abs(sum(timings[s] for s in starting) - timings["start_s"]) <= 0.003
    assert timings["preprocess_s"] > 0 and timings["fsync_s"] > 0  # 4 shards: each fsynced with its index
    assert sum(timings[s] for s in stages) <= report["elapsed_s"] + 0.01 <= sum(timings[s] for s in stages) + 0.5
    assert timings["fsync_s"] + timings["writer_wait_s"] <= timings["preprocess_s"] + timings["finish_s"]
    assert "60 samples in 8 batches, 4 shards" in result.stderr  # type: ignore[attr-defined]
    assert "Traceback" not in result.stderr  # type: ignore[attr-defined]


def test_no_staging_left_beside_the_output(built: tuple) -> None:
    out, _, _ = built
    assert not (out.parent / f".{out.name}.batchctl").exists()


def test_corrupt_files_are_skipped_named_and_counted(image_folder: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(image_folder / "cat", src / "cat")
    (src / "cat" / "broken.jpg").write_bytes(b"\xff\xd8\xff not really a jpeg")
    (src / "cat" / "empty.png").write_bytes(b"")
    (src / "cat" / "notes.txt").write_text("ignored: not an image")
    (src / ".hidden").mkdir()
    (src / ".hidden" / "x.jpg").write_bytes(b"hidden files are not even looked at")
    out, report = tmp_path / "out.zarr", tmp_path / "r.json"
    result = run_cli("build", src, "-o", out, "--batch-size", "4", "--report", report)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("skipped")]
    assert sorted(line.split(":")[0] for line in lines) == ["skipped cat/broken.jpg", "skipped cat/empty.png"]
    data = json.loads(report.read_text())
    assert sorted(e["source"] for e in data["errors"]) == ["cat/broken.jpg", "cat/empty.png"]
    assert data["ignored"] == {"count": 1, "paths": ["cat/notes.txt"]}  # named, in the report and in `info`
    info = run_cli("info", out)
    header = "ignored (not taken by the preprocessor, not regular files, or outside the class folders):"
    assert f"{header}\n    cat/notes.txt" in info.stdout
    ds = batchctl.open(out)
    assert ds.num_samples == 20
    assert set(np.concatenate([b["source"] for b in ds])) == image_files(src) - {"cat/broken.jpg", "cat/empty.png"}
    assert zarr.open_group(str(out)).attrs["batchctl"]["errors"] == 2


def test_strict_fails_and_publishes_nothing(image_folder: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(image_folder / "dog", src / "dog")
    (src / "dog" / "broken.jpg").write_bytes(b"garbage")
    out, report = tmp_path / "out.zarr", tmp_path / "r.json"
    result = run_cli("build", src, "-o", out, "--strict", "--report", report)
    assert result.returncode == 1
    assert "dog/broken.jpg" in result.stderr and "Traceback" not in result.stderr
    assert not out.exists()
    assert json.loads(report.read_text())["status"] == "failed"


def test_flat_folder_has_no_labels(tmp_path: Path) -> None:
    from batchctl.synthetic import make_image_folder

    make_image_folder(tmp_path / "flat", 5, classes=(), sides=(64, 100))
    out = tmp_path / "flat.zarr"
    assert run_cli("build", tmp_path / "flat", "-o", out, "--crop", "32", "--resize", "40").returncode == 0
    ds = batchctl.open(out)
    assert ds.classes is None and "label" not in ds.fields
    assert ds.fields["image"] == ((32, 32, 3), np.dtype("uint8"))


def test_seed_makes_the_dispatch_order_repeatable(image_folder: Path, tmp_path: Path) -> None:
    def order(*extra: str) -> list[str]:
        out = tmp_path / f"o{len(list(tmp_path.iterdir()))}.zarr"
        result = run_cli("build", image_folder, "-o", out, "--workers", "1", "--crop", "16", "--resize", "16", *extra)
        assert result.returncode == 0, result.stderr
        return [str(s) for s in fmt.decode_sources(zarr.open_group(str(out))["source"][:])]

    ordered, default, seed1, seed1_again, seed2 = (
        order("--sorted"),
        order(),
        order("--seed", "1"),
        order("--seed", "1"),
        order("--seed", "2"),
    )
    assert ordered == sorted(ordered)
    assert default != ordered and default == order("--seed", "0")  # shuffled by default, with seed 0
    assert seed1 == seed1_again and seed1 != seed2 and seed1 != default
    assert sorted(seed1) == sorted(ordered)


def last_codec(out: Path, name: str) -> dict[str, Any]:
    codecs: list[dict[str, Any]] = json.loads((out / name / "zarr.json").read_text())["codecs"][0]["configuration"][
        "codecs"
    ]
    return codecs[-1]


@pytest.mark.parametrize(("compression", "last"), [("zstd", "zstd"), ("blosc", "crc32c"), ("none", "crc32c")])
def test_every_compression_checksums_every_chunk(
    image_folder: Path, tmp_path: Path, compression: str, last: str
) -> None:
    out = tmp_path / "c.zarr"
    result = run_cli(
        "build", image_folder / "fish", "-o", out, "--compression", compression, "--crop", "16", "--resize", "16"
    )
    assert result.returncode == 0, result.stderr
    assert last_codec(out, "image")["name"] == last
    if last == "zstd":
        assert last_codec(out, "image")["configuration"] == {"level": 1, "checksum": True}
    assert batchctl.open(out).num_samples == 20


def test_auto_compresses_only_what_shrinks(built: tuple, tmp_path: Path) -> None:
    out, _, _ = built
    assert last_codec(out, "image")["name"] == "crc32c"  # photo-like pixels shrink ~10%: stored raw, checksummed
    assert (
        last_codec(out, metadata.SOURCE_INDEX)["name"] == "zstd" and last_codec(out, metadata.LABEL)["name"] == "zstd"
    )
    src = tmp_path / "steps"
    src.mkdir()
    for i in range(10):
        np.save(src / f"{i}.npy", np.full(1000, i, dtype=np.int32))
    steps = tmp_path / "steps.zarr"
    result = run_cli("build", src, "-o", steps, "--preprocess", "npy", "--batch-size", "4")
    assert result.returncode == 0, result.stderr
    assert last_codec(steps, "array")["name"] == "zstd"
    rows = [row for batch in batchctl.open(steps).iter_batches() for row in batch["array"]]
    assert sorted(int(row[0]) for row in rows) == list(range(10)) and all(len(set(row)) == 1 for row in rows)
    # a field zstd shrinks by ~40% (like greyscale photos among colour ones): not worth its CPU
    # at build and read time, stored raw; one it halves: zstd
    for zeros, codec in ((0.4, "crc32c"), (0.6, "zstd")):
        src = tmp_path / f"zeros{zeros}"
        src.mkdir()
        rng = np.random.default_rng(0)
        for i in range(10):
            row = rng.integers(0, 256, 3000, dtype=np.uint8)
            row[int(3000 * (1 - zeros)) :] = 0
            np.save(src / f"{i}.npy", row)
        out = tmp_path / f"zeros{zeros}.zarr"
        result = run_cli("build", src, "-o", out, "--preprocess", "npy", "--batch-size", "4")
        assert result.returncode == 0, result.stderr
        assert last_codec(out, "array")["name"] == codec


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--compression", "lz4"], "compression"),
        (["--batch-size", "0"], "batch-size"),
        (["--preprocess", "nope"], "preprocess"),
        (["--preprocess", "no_such_module_xyz:fn"], "no_such_module_xyz"),
        (["--preprocess", "tests/plugins.py:missing"], "missing"),
    ],
)
def test_usage_errors_exit_2_with_a_message(image_folder: Path, tmp_path: Path, args: list[str], needle: str) -> None:
    result = run_cli("build", image_folder, "-o", tmp_path / "x.zarr", *args)
    assert result.returncode == 2
    assert needle in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "x.zarr").exists()


def test_missing_source_is_a_usage_error(tmp_path: Path) -> None:
    result = run_cli("build", tmp_path / "nowhere", "-o", tmp_path / "x.zarr")
    assert result.returncode == 2 and "nowhere" in result.stderr


def test_refuses_to_replace_a_folder_that_is_not_a_dataset(image_folder: Path, tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("do not delete")
    result = run_cli("build", image_folder, "-o", precious)
    assert result.returncode == 2 and "not a batchctl dataset" in result.stderr
    assert (precious / "thesis.tex").read_text() == "do not delete"


def test_quiet_prints_only_errors(image_folder: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(image_folder / "cat", src / "cat")
    (src / "cat" / "bad.png").write_text("text named .png")
    result = run_cli("build", src, "-o", tmp_path / "q.zarr", "--quiet", "--crop", "16", "--resize", "16")
    assert result.returncode == 0
    assert result.stderr.splitlines() == [result.stderr.splitlines()[0]]
    assert result.stderr.startswith("skipped cat/bad.png:")


def test_python_api_returns_a_report(image_folder: Path, tmp_path: Path) -> None:
    report = batchctl.build(
        image_folder / "dog",
        tmp_path / "api.zarr",
        batch_size=5,
        workers=2,
        preprocess_options={"crop": 16, "resize": 16},
    )
    assert report.status == "complete" and report.samples == 20 and report.batches == 4
    ds = batchctl.open(tmp_path / "api.zarr")
    assert ds[3]["image"].shape == (5, 16, 16, 3)


def test_modes_and_tiny_images_are_handled(tmp_path: Path) -> None:
    src = tmp_path / "modes"
    src.mkdir()
    rng = np.random.default_rng(1)
    rgb = Image.fromarray(rng.integers(0, 255, (50, 70, 3), dtype=np.uint8))
    rgb.convert("L").save(src / "grey.png")
    rgb.convert("P").save(src / "palette.png")
    rgb.convert("RGBA").save(src / "rgba.png")
    rgb.convert("CMYK").save(src / "cmyk.jpg")
    Image.fromarray((rng.integers(0, 65535, (40, 30))).astype(np.uint16)).save(src / "grey16.png")
    rgb.resize((1, 1)).save(src / "one.png")
    rgb.save(src / "img.webp")
    rgb.save(src / "img.tiff")
    rgb.save(src / "img.bmp")
    rgb.save(src / "img.GIF")
    out = tmp_path / "modes.zarr"
    result = run_cli("build", src, "-o", out, "--strict", "--crop", "32", "--resize", "40")
    assert result.returncode == 0, result.stderr
    ds = batchctl.open(out)
    assert ds.num_samples == 10
    rows = {str(s): img for b in ds for s, img in zip(b["source"], b["image"], strict=True)}
    for name in ("grey.png", "palette.png", "rgba.png", "cmyk.jpg", "grey16.png", "img.webp"):
        assert mean_abs_diff(rows[name], torchvision_reference(src / name, 40, 32)) <= 3.0, name


def test_python_api_works_from_a_thread(image_folder: Path, tmp_path: Path) -> None:
    import threading

    reports: list[batchctl.BuildReport] = []
    worker = threading.Thread(
        target=lambda: reports.append(
            batchctl.build(
                image_folder / "fish", tmp_path / "t.zarr", workers=1, preprocess_options={"crop": 8, "resize": 8}
            )
        )
    )
    worker.start()
    worker.join(120)
    assert reports and reports[0].status == "complete" and reports[0].samples == 20


def test_build_takes_as_keywords_the_build_options_and_every_cli_option() -> None:
    import dataclasses
    import inspect

    from batchctl.build import BuildKwargs, BuildOptions
    from batchctl.cli import build as cli_build

    keywords = set(BuildKwargs.__annotations__)
    assert {f.name for f in dataclasses.fields(BuildOptions)} <= keywords
    cli = {"sorted" if name == "sorted_order" else name for name in inspect.signature(cli_build).parameters}
    assert cli - {"source", "output"} <= keywords, cli - keywords
