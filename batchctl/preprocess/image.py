"""The default image preprocessing: torchvision's Resize(resize) + CenterCrop(crop), uint8; or,
with `store="jpeg"` (or "png"), the image re-encoded with its longer side at most `max_side`, for a
loader to decode and crop at read time (`batchctl.read.augment`).

EXIF orientation is applied (the image is stored upright, as every viewer shows it); torchvision's
reference does not do this, so only EXIF-rotated photos differ from it. JPEGs are decoded with
Pillow's draft mode at the smallest DCT scale that still leaves at least `DRAFT_MARGIN` times the
target size, which is several times faster for big photos and stays well within the accuracy
bound (mean absolute difference <= 3 grey levels; tests/test_build.py measures it against the
torchvision reference).
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from batchctl.errors import UsageError
from batchctl.preprocess.base import Preprocessor

STORES = ("pixels", "jpeg", "png")
EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
DRAFT_MARGIN = 2
ORIENTATION = 0x0112  # the EXIF tag


def resized_size(width: int, height: int, resize: int) -> tuple[int, int]:
    """torchvision's rule: the shorter side becomes `resize`, the longer `int(resize * long / short)`."""
    if width <= height:
        return resize, int(resize * height / width)
    return int(resize * width / height), resize


def center_crop(pixels: np.ndarray, crop: int) -> np.ndarray:
    """torchvision's CenterCrop: `top = round((h - crop) / 2)`, zero padding when the image is smaller."""
    height, width = pixels.shape[:2]
    if height < crop or width < crop:
        pad_h, pad_w = max(crop - height, 0), max(crop - width, 0)
        pixels = np.pad(
            pixels,
            ((pad_h // 2, pad_h - pad_h // 2), (pad_w // 2, pad_w - pad_w // 2), (0, 0)),
        )
        height, width = pixels.shape[:2]
    top = int(round((height - crop) / 2.0))
    left = int(round((width - crop) / 2.0))
    return pixels[top : top + crop, left : left + crop]


def load_resized(path: Path, resize: int, draft: bool = True) -> Image.Image:
    """Decode, orient and resize one image to the shorter side `resize`, in RGB."""
    with Image.open(path) as img:
        target = resized_size(img.width, img.height, resize)
        if draft and img.format == "JPEG":
            img.draft("RGB", (target[0] * DRAFT_MARGIN, target[1] * DRAFT_MARGIN))
        # exif_transpose copies the image even when there is nothing to turn: skip it then
        oriented = ImageOps.exif_transpose(img) if img.getexif().get(ORIENTATION, 1) != 1 else img
        rgb = to_rgb(oriented)
    target = resized_size(rgb.width, rgb.height, resize)
    return rgb.resize(target, Image.Resampling.BILINEAR)


def to_rgb(img: Image.Image) -> Image.Image:
    """8-bit RGB. Pillow's own convert("RGB") clips 16-bit and 32-bit greyscale at 255 (a flat
    white picture); these are scaled to 8 bits instead: 16-bit and integer images by 1/257, float
    images in [0, 1] by 255, anything else by its own range."""
    if img.mode.startswith("I;16") or img.mode in ("I", "F"):
        values = np.asarray(img, dtype=np.float64)
        low, high = float(values.min()), float(values.max())
        if img.mode == "F" and low >= 0 and high <= 1:
            scaled = values * 255
        elif img.mode != "F" and low >= 0 and high <= 65535:
            scaled = values / 257
        else:
            scaled = (values - low) * (255 / (high - low or 1))
        img = Image.fromarray(np.clip(scaled.round(), 0, 255).astype(np.uint8))
    return img.convert("RGB")


def preprocess_image(
    path: Path,
    resize: int = 256,
    crop: int = 224,
    layout: str = "hwc",
    draft: bool = True,
    store: str = "pixels",
    max_side: int = 512,
    quality: int = 90,
) -> dict[str, np.ndarray]:
    if store != "pixels":
        return encode_image(path, store, max_side, quality, draft)
    pixels = center_crop(np.asarray(load_resized(path, resize, draft)), crop)
    if layout == "chw":
        pixels = pixels.transpose(2, 0, 1)
    return {"image": np.ascontiguousarray(pixels)}


def bounded_size(width: int, height: int, max_side: int) -> tuple[int, int]:
    """The size with the longer side at most `max_side` (never enlarged), the aspect kept."""
    scale = min(1.0, max_side / max(width, height))
    return max(1, round(width * scale)), max(1, round(height * scale))


def encode_image(path: Path, store: str, max_side: int, quality: int, draft: bool = True) -> dict[str, np.ndarray]:
    """The image upright, in RGB, its longer side at most `max_side`, encoded as JPEG of
    `quality` (4:2:0, as most photos are) or as PNG; with its stored height and width."""
    with Image.open(path) as img:
        if draft and img.format == "JPEG":
            img.draft("RGB", bounded_size(img.width, img.height, max_side * DRAFT_MARGIN))
        oriented = ImageOps.exif_transpose(img) if img.getexif().get(ORIENTATION, 1) != 1 else img
        rgb = to_rgb(oriented)
    size = bounded_size(rgb.width, rgb.height, max_side)
    if size != rgb.size:
        rgb = rgb.resize(size, Image.Resampling.BILINEAR)
    out = io.BytesIO()
    if store == "jpeg":
        rgb.save(out, "JPEG", quality=quality)
    else:
        rgb.save(out, "PNG")
    return {
        "image": np.frombuffer(out.getbuffer(), np.uint8).copy(),
        "height": np.array(rgb.height, np.int32),
        "width": np.array(rgb.width, np.int32),
    }


PIXEL_OPTIONS = ("resize", "crop", "layout")
ENCODED_OPTIONS = ("store", "max_side", "quality")


def relevant(options: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """Stored pixels record resize, crop, layout and draft (as before `store` existed); an
    encoded image its store, max_side, quality and draft. An option of the other kind is refused."""
    encoded = options["store"] != "pixels"
    other = ENCODED_OPTIONS[1:] if not encoded else PIXEL_OPTIONS
    given_other = sorted(name for name in other if name in given)
    if given_other:
        kind = f"--store {options['store']}" if encoded else "--store jpeg or png"
        raise UsageError(f"--{given_other[0].replace('_', '-')} is not for {kind}; leave it out.")
    drop = PIXEL_OPTIONS if encoded else ENCODED_OPTIONS
    return {name: value for name, value in options.items() if name not in drop}


def ragged_for(options: Mapping[str, Any]) -> tuple[str, ...]:
    return ("image",) if options.get("store", "pixels") != "pixels" else ()


def check_options(options: Mapping[str, Any]) -> None:
    if options["store"] not in STORES:
        raise UsageError(f"Expected --store one of {', '.join(STORES)}, got {options['store']!r} instead.")
    if not isinstance(options["quality"], int) or not 1 <= options["quality"] <= 95:
        raise UsageError(f"Expected --quality between 1 and 95, got {options['quality']!r} instead.")
    if not isinstance(options["max_side"], int) or options["max_side"] < 1:
        raise UsageError(f"Expected --max-side to be a positive integer, got {options['max_side']!r} instead.")
    if options["layout"] not in ("hwc", "chw"):
        raise UsageError(f"Expected --layout hwc or chw, got {options['layout']!r} instead.")
    for name in ("resize", "crop"):
        if not isinstance(options[name], int) or options[name] < 1:
            raise UsageError(f"Expected --{name} to be a positive integer, got {options[name]!r} instead.")


def describe(options: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    store = options.get("store", "pixels")
    if store != "pixels":
        return {
            "image": {
                "dimension_names": ["byte"],
                "attributes": {
                    "meaning": f"the image encoded as {store.upper()} (RGB, upright), its longer side at most max_side",
                    "encoding": f"image/{store}",
                    "max_side": options.get("max_side"),
                    "quality": options.get("quality") if store == "jpeg" else None,
                },
            },
            "height": {"attributes": {"meaning": "the stored image's height in pixels"}},
            "width": {"attributes": {"meaning": "the stored image's width in pixels"}},
        }
    hwc = options.get("layout", "hwc") == "hwc"
    return {
        "image": {
            "dimension_names": ["height", "width", "channel"] if hwc else ["channel", "height", "width"],
            "attributes": {
                "meaning": "RGB pixels: red, green, blue channels, 0 (none) to 255 (full), sRGB as decoded",
                "color_space": "RGB",
                "value_range": [0, 255],
                "layout": "hwc" if hwc else "chw",
                "resize": options.get("resize"),
                "crop": options.get("crop"),
            },
        }
    }


PREPROCESSOR = Preprocessor(
    name="image",
    describe=describe,
    code="image/1",  # raise when the output for the same file and options changes
    fn=preprocess_image,
    extensions=EXTENSIONS,
    defaults={
        "resize": 256,
        "crop": 224,
        "layout": "hwc",
        "draft": True,
        "store": "pixels",
        "max_side": 512,
        "quality": 90,
    },
    check=check_options,
    relevant=relevant,
    ragged_for=ragged_for,
)
