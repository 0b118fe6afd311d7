"""Encoded images decoded at read time, with the crops training and evaluation take from the
stored picture: torchvision's `RandomResizedCrop(size, scale, ratio)` and a horizontal flip, or a
centre crop. Pillow decodes (it releases the GIL, so the loader's threads decode side by side),
in draft mode where the crop allows: a JPEG is decoded at the smallest DCT scale that still
leaves the crop at least `size` pixels a side. Each row's random draws are a pure function of
(seed, epoch, row), so an exact resume reproduces the same crops, whatever the ranks or workers.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from batchctl.errors import FormatError, UsageError

Box = tuple[int, int, int, int]  # (left, top, width, height) in the stored image's pixels


@dataclass(frozen=True)
class Crop:
    """What a loader makes of an encoded image: a `size` x `size` RGB crop, random
    (`RandomResizedCrop` of an area fraction in `scale` and an aspect ratio in `ratio`, then a
    horizontal flip half the time when `flip`) or central (the centred square of `fraction` of
    the shorter side: `Resize(size / fraction)` then `CenterCrop(size)`, ImageNet's evaluation
    at the default 0.875)."""

    size: int
    random: bool = True
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: bool = False
    fraction: float = 0.875

    def checked(self) -> Crop:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise UsageError(f"Expected a crop size that is an int >= 1, got {self.size!r} instead.")
        for name, (low, high) in (("scale", self.scale), ("ratio", self.ratio)):
            if not 0 < low <= high:
                raise UsageError(f"Expected {name}=(low, high) with 0 < low <= high, got {(low, high)!r} instead.")
        if not 0 < self.fraction <= 1:
            raise UsageError(f"Expected a centre crop fraction in (0, 1], got {self.fraction!r} instead.")
        return self

    def box(self, width: int, height: int, rng: np.random.Generator) -> Box:
        """The region of a `width` x `height` image this crop takes."""
        if self.random:
            return random_resized_box(width, height, self.scale, self.ratio, rng)
        side = max(1, round(min(width, height) * self.fraction))
        return (width - side) // 2, (height - side) // 2, side, side

    def decode_into(self, data: Any, out: np.ndarray, rng: np.random.Generator) -> None:
        """Decode one encoded image and write its crop, `size` x `size` x 3 uint8, into `out`."""
        try:
            with Image.open(io.BytesIO(memoryview(data).cast("B"))) as img:
                width, height = img.size
                left, top, w, h = self.box(width, height, rng)
                flip = self.random and self.flip and rng.random() < 0.5
                if img.format == "JPEG":  # the smallest DCT scale that keeps the crop >= size a side
                    factor = min(1.0, max(self.size / w, self.size / h))
                    img.draft("RGB", (math.ceil(width * factor), math.ceil(height * factor)))
                sx, sy = img.width / width, img.height / height
                rgb = img if img.mode == "RGB" else img.convert("RGB")
                box = (left * sx, top * sy, (left + w) * sx, (top + h) * sy)
                cropped = rgb.resize((self.size, self.size), Image.Resampling.BILINEAR, box=box)
        except (OSError, ValueError, SyntaxError) as exc:  # what Pillow raises on bytes it cannot decode
            raise FormatError(f"an encoded image does not decode ({exc})") from exc
        if flip:
            cropped = cropped.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        out[...] = np.asarray(cropped)


def random_resized_box(
    width: int, height: int, scale: tuple[float, float], ratio: tuple[float, float], rng: np.random.Generator
) -> Box:
    """torchvision's `RandomResizedCrop.get_params`: up to ten tries at an area fraction drawn
    uniformly from `scale` and an aspect ratio log-uniformly from `ratio` that fit the image, at a
    uniform place; failing that, the whole image cut to the nearest ratio in bounds, centred."""
    area = width * height
    log_low, log_high = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_low, log_high))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return left, top, w, h
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        w, h = int(round(height * max(ratio))), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def row_rng(seed: int, epoch: int, row: int) -> np.random.Generator:
    """The random draws of one stored row in one epoch: the same wherever and whenever it is read."""
    return np.random.default_rng([seed, epoch, row, 46])


def crop_of(
    random_resized_crop: int | None,
    center_crop: int | None,
    flip: bool,
    scale: tuple[float, float],
    ratio: tuple[float, float],
) -> Crop | None:
    """The `Crop` a loader's keywords ask for (none, one kind, never both)."""
    if random_resized_crop is not None and center_crop is not None:
        raise UsageError("Expected random_resized_crop= or center_crop=, not both.")
    if random_resized_crop is not None:
        return Crop(random_resized_crop, True, tuple(scale), tuple(ratio), bool(flip)).checked()  # type: ignore[arg-type]
    if center_crop is not None:
        if flip:
            raise UsageError("flip=True is for random_resized_crop= (a centre crop for evaluation is not flipped).")
        return Crop(center_crop, False).checked()
    return None


class Decoded:
    """A dataset (or view) read with its encoded image fields decoded and cropped (`Crop`): each
    such field reads as `size` x `size` x 3 uint8 rows, straight into the places the loader hands;
    the draws of stored row r of batch i are `row_rng(seed, epoch, i * batch_size + r)`."""

    def __init__(self, base: Any, crop: Crop, names: Sequence[str], seed: int, epoch: int) -> None:
        self.base, self.crop, self.names, self.seed, self.epoch = base, crop, list(names), seed, epoch
        self.path, self.build_id, self.remote = base.path, base.build_id, base.remote
        self.batch_size, self.num_samples = base.batch_size, base.num_samples
        self.selected, self.stored_rows = base.selected, base.stored_rows

    @property
    def fields(self) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]:
        shape = (self.crop.size, self.crop.size, 3)
        return {name: (shape, np.dtype(np.uint8)) if name in self.names else f for name, f in self.base.fields.items()}

    @property
    def encodings(self) -> dict[str, str]:
        return {name: kind for name, kind in self.base.encodings.items() if name not in self.names}

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return self.read_batch(index)

    def read_batch(
        self, index: int, into: Mapping[str, list[np.ndarray]] | None = None, fields: list[str] | None = None
    ) -> dict[str, np.ndarray]:
        into = dict(into or {})
        decoded_into = {name: into.pop(name) for name in self.names if name in into}
        asked = [n for n in self.fields if n not in into and n not in decoded_into] if fields is None else fields
        got = self.base.read_batch(index, into, [*asked, *decoded_into])
        for name in [n for n in self.names if n in got]:
            rows = got.pop(name)
            targets = decoded_into.get(name)
            if targets is None:
                got[name] = np.empty((len(rows), self.crop.size, self.crop.size, 3), np.uint8)
                targets = list(got[name])
            first = index * self.batch_size
            for r, data in enumerate(rows):
                self.crop.decode_into(data, targets[r], row_rng(self.seed, self.epoch, first + r))
        return {name: got[name] for name in asked}


def image_fields(encodings: Mapping[str, str]) -> list[str]:
    """The fields holding encoded images (`image/jpeg`, `image/png`: docs/format.md)."""
    return [name for name, encoding in encodings.items() if encoding.startswith("image/")]
