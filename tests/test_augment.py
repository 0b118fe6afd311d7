"""Encoded images: `--store jpeg/png` by the real CLI, decoded at read time with
torchvision's RandomResizedCrop rules and a flip, or a centre crop; the same (seed, epoch, row)
gives the same crop after a resume."""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import batchctl
from batchctl.read.augment import random_resized_box, row_rng
from batchctl.read.inspect import verify
from tests.conftest import run_cli
from tests.reference import mean_abs_diff, torchvision_reference


@pytest.fixture(scope="module")
def encoded(image_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("encoded")
    built = {}
    for store in ("jpeg", "png", "pixels"):
        out = root / f"{store}.zarr"
        extra = ["--max-side", "300"] if store != "pixels" else ["--resize", "256", "--crop", "224"]
        result = run_cli("build", image_folder, "-o", out, "--batch-size", "8", "--store", store, *extra)
        assert result.returncode == 0, result.stderr
        built[store] = out
    return built


def stored_reference(path: Path, max_side: int) -> np.ndarray:
    """The picture as `--store` keeps it: RGB, its longer side at most `max_side` (Pillow's bilinear)."""
    with Image.open(path) as img:
        rgb = img.convert("RGB")
    scale = min(1.0, max_side / max(rgb.size))
    size = (max(1, round(rgb.width * scale)), max(1, round(rgb.height * scale)))
    return np.asarray(rgb.resize(size, Image.Resampling.BILINEAR) if size != rgb.size else rgb)


def test_encoded_images_decode_to_the_stored_size_within_jpegs_tolerance(
    encoded: dict[str, Path], image_folder: Path
) -> None:
    for store in ("jpeg", "png"):
        ds = batchctl.open(encoded[store])
        assert ds.encodings == {"image": f"image/{store}"}
        assert ds.attrs.preprocess["options"] == {"draft": True, "store": store, "max_side": 300, "quality": 90}
        rows = 0
        for i in range(len(ds)):
            batch = ds[i]
            for data, height, width, source in zip(
                batch["image"], batch["height"], batch["width"], batch["source"], strict=True
            ):
                with Image.open(io.BytesIO(data.tobytes())) as img:
                    assert img.format == store.upper() and img.size == (width, height) and max(img.size) <= 300
                    got = np.asarray(img.convert("RGB"))
                want = stored_reference(image_folder / source, 300)
                assert got.shape == want.shape
                if store == "png" and source.endswith(".png"):  # lossless, no draft: exactly the resized source
                    assert np.array_equal(got, want), source
                else:  # JPEG's loss (and a JPEG source's draft decoding)
                    assert mean_abs_diff(got, want) <= 6.0, (
                        source
                    )  # (noise-like synthetic photos: the worst case for JPEG)
                rows += 1
        assert rows == len(list(image_folder.rglob("*.*")))
        assert [str(p) for p in verify(encoded[store])] == []
    assert sum(p.stat().st_size for p in encoded["jpeg"].rglob("*")) < sum(
        p.stat().st_size for p in encoded["pixels"].rglob("*")
    )


def test_options_of_the_other_kind_are_refused(image_folder: Path, tmp_path: Path) -> None:
    result = run_cli("build", image_folder, "-o", tmp_path / "x.zarr", "--store", "jpeg", "--crop", "100")
    assert result.returncode == 2 and "--crop is not for --store jpeg" in result.stderr
    result = run_cli("build", image_folder, "-o", tmp_path / "y.zarr", "--max-side", "100")
    assert result.returncode == 2 and "--max-side is not for --store jpeg or png" in result.stderr
    assert not (tmp_path / "x.zarr").exists() and not (tmp_path / "y.zarr").exists()


def test_random_resized_crop_follows_torchvisions_rules() -> None:
    """Area fraction within `scale`, aspect within `ratio`, inside the image, at a uniform place;
    and torchvision's fallback when ten tries fail: the whole image cut to the nearest ratio."""
    rng = np.random.default_rng(0)
    areas, aspects, lefts = [], [], []
    for _ in range(4000):
        width, height = int(rng.integers(50, 900)), int(rng.integers(50, 900))
        left, top, w, h = random_resized_box(width, height, (0.08, 1.0), (3 / 4, 4 / 3), rng)
        assert left >= 0 and left + w <= width and top >= 0 and top + h <= height and w > 0 and h > 0
        if (w, h) == (width, height) or left == (width - w) // 2 and top == (height - h) // 2:
            continue  # perhaps the fallback
        areas.append(w * h / (width * height))
        aspects.append(w / h)
        lefts.append(left / max(width - w, 1))
    rounding = 0.03  # w and h are rounded to whole pixels
    assert min(areas) >= 0.08 - rounding and max(areas) <= 1.0 + rounding
    assert min(aspects) >= 3 / 4 - rounding and max(aspects) <= 4 / 3 + rounding
    assert abs(np.mean(np.log(aspects))) < 0.02  # log-uniform about 1
    assert 0.45 < np.mean(lefts) < 0.55  # a uniform place
    assert np.quantile(areas, 0.01) < 0.1 and max(areas) > 0.9  # the whole range is drawn
    assert len(areas) > 3400  # the fallback (or a centred draw) is rare, even with aspects up to 18:1

    # ten tries cannot fit an area of 150-200%: the fallback, centred, clamped to the ratio bounds
    assert random_resized_box(400, 100, (1.5, 2.0), (3 / 4, 4 / 3), rng) == ((400 - 133) // 2, 0, 133, 100)
    assert random_resized_box(100, 400, (1.5, 2.0), (3 / 4, 4 / 3), rng) == (0, (400 - 133) // 2, 100, 133)
    assert random_resized_box(300, 300, (1.5, 2.0), (3 / 4, 4 / 3), rng) == (0, 0, 300, 300)
    assert math.isclose(400 / 3, 133.33, rel_tol=1e-3)


def test_centre_crop_is_resize_then_centre_crop(encoded: dict[str, Path], tmp_path: Path) -> None:
    """`center_crop=224` of the stored picture reads as Resize(256) + CenterCrop(224) of it would
    (one resampling of the central region against two steps: they differ by a fraction of a pixel)."""
    ds = batchctl.open(encoded["png"])
    batch = next(iter(ds.loader(batch_size=8, shuffle=False, center_crop=224)))
    assert batch["image"].shape == (8, 224, 224, 3) and batch["image"].dtype == np.uint8
    for number, (got, data) in enumerate(zip(batch["image"], ds[0]["image"], strict=True)):
        stored = tmp_path / f"stored{number}.png"
        stored.write_bytes(data.tobytes())
        assert mean_abs_diff(got, torchvision_reference(stored, resize=256, crop=224)) <= 5.0


def test_crops_are_a_function_of_seed_epoch_and_row(encoded: dict[str, Path]) -> None:
    ds = batchctl.open(encoded["jpeg"])
    options = {"batch_size": 8, "random_resized_crop": 64, "flip": True, "seed": 4, "mix": 2}
    loader = ds.loader(**options)
    iterator = iter(loader)
    next(iterator)
    state = loader.state_dict()
    expected = [batch["image"].copy() for batch in iterator]
    resumed = ds.loader(**options)
    resumed.load_state_dict(state)
    assert all(np.array_equal(a, b["image"]) for a, b in zip(expected, resumed, strict=True))
    epoch0 = [b["image"] for b in ds.loader(**options)]
    other = ds.loader(**options)
    other.set_epoch(1)
    by_source_0 = {
        s: img
        for b, imgs in zip(ds.loader(**options), epoch0, strict=True)
        for s, img in zip(b["source"], imgs, strict=True)
    }
    by_source_1 = {s: img for b in other for s, img in zip(b["source"], b["image"], strict=True)}
    assert sum(not np.array_equal(by_source_0[s], by_source_1[s]) for s in by_source_0.keys() & by_source_1.keys()) > 0
    assert row_rng(1, 2, 3).random() == row_rng(1, 2, 3).random() != row_rng(1, 3, 3).random()


def test_crop_needs_an_encoded_image_field(encoded: dict[str, Path]) -> None:
    with pytest.raises(batchctl.UsageError, match="no encoded image field"):
        batchctl.open(encoded["pixels"]).loader(random_resized_crop=64)
    with pytest.raises(batchctl.UsageError, match="not both"):
        batchctl.open(encoded["jpeg"]).loader(random_resized_crop=64, center_crop=64)


def test_torch_workers_decode_and_crop(encoded: dict[str, Path]) -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader

    from batchctl.torch import IterableBatches

    stream = IterableBatches(encoded["jpeg"], batch_size=8, random_resized_crop=48, flip=True)
    batches = list(DataLoader(stream, batch_size=None, num_workers=2))
    assert batches and all(b["image"].shape == (8, 48, 48, 3) and b["image"].dtype == torch.uint8 for b in batches)
    assert batches[0]["height"].dtype == torch.int32


def test_preview_draws_the_stored_pictures(encoded: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "grid.png"
    result = run_cli("preview", encoded["jpeg"], "-o", out, "--count", "4")
    assert result.returncode == 0, result.stderr
    with Image.open(out) as img:
        colours = {tuple(v) for v in np.asarray(img.convert("RGB")).reshape(-1, 3)[::53].tolist()}
    assert len(colours) > 50  # pictures, not the bytes of their files drawn as pixels


def test_a_mixture_decodes_and_crops_and_resumes_the_same_crops(encoded: dict[str, Path]) -> None:
    sources = {"jpeg": encoded["jpeg"], "png": encoded["png"]}
    options = {"batch_size": 8, "seed": 2, "random_resized_crop": 40, "flip": True}
    mixture = batchctl.mix(sources, {"jpeg": 3, "png": 1}, **options)
    iterator = iter(mixture)
    first = next(iterator)
    assert first["image"].shape == (8, 40, 40, 3) and first["dataset"].tolist().count(1) == 2
    state = mixture.state_dict()
    expected = [batch["image"].copy() for batch in iterator]
    resumed = batchctl.mix(sources, {"jpeg": 3, "png": 1}, **options)
    resumed.load_state_dict(state)
    assert all(np.array_equal(a, b["image"]) for a, b in zip(expected, resumed, strict=True))
    with pytest.raises(batchctl.UsageError, match="share no encoded image field"):
        batchctl.mix({"a": encoded["pixels"], "b": encoded["pixels"]}, {"a": 1, "b": 1}, batch_size=8, center_crop=32)
