"""Synthetic input folders for the demo, the tests and the benchmarks (nothing is downloaded).

Images look like photographs to a codec: smooth random fields plus noise and hard edges, so
JPEG sizes and decode times are realistic, unlike flat colours.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def photo(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    coarse = rng.random((height // 24 + 2, width // 24 + 2, 3)) * 255
    smooth = np.asarray(Image.fromarray(coarse.astype(np.uint8)).resize((width, height), Image.Resampling.BICUBIC))
    pixels = smooth.astype(np.float32) + rng.normal(0, 10, (height, width, 3))
    for _ in range(4):
        x, y = int(rng.integers(0, width)), int(rng.integers(0, height))
        pixels[y : y + height // 5, x : x + width // 5] = rng.integers(0, 255, 3)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def make_image_folder(
    root: Path,
    count: int,
    classes: tuple[str, ...] = ("cat", "dog", "fish"),
    sides: tuple[int, int] = (300, 900),
    png_every: int = 10,
    seed: int = 0,
) -> list[Path]:
    """`count` images spread over class folders (flat when `classes` is empty); JPEG quality
    85-95, every `png_every`-th a PNG."""
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        folder = root / classes[i % len(classes)] if classes else root
        folder.mkdir(parents=True, exist_ok=True)
        width, height = (int(v) for v in rng.integers(sides[0], sides[1] + 1, 2))
        image = photo(width, height, seed * 1_000_003 + i)
        if png_every and i % png_every == png_every - 1:
            path = folder / f"img{i:05d}.png"
            image.save(path)
        else:
            path = folder / f"img{i:05d}.jpg"
            image.save(path, quality=int(rng.integers(85, 96)))
        paths.append(path)
    return paths
