"""An independent copy of torchvision's Resize(256) + CenterCrop(224) on PIL, to check against."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def torchvision_reference(path: Path, resize: int = 256, crop: int = 224) -> np.ndarray:
    with Image.open(path) as img:
        if img.mode.startswith("I;16") or img.mode == "I":  # PIL's convert clips these at 255 (flat
            # white); batchctl scales 16-bit grey to 8 bits instead (docs/preprocessors.md), as here
            img = Image.fromarray((np.asarray(img, dtype=np.float64) / 257).round().astype(np.uint8))
        rgb = img.convert("RGB")
    w, h = rgb.size
    short, long = min(w, h), max(w, h)
    new_short, new_long = resize, int(resize * long / short)
    size = (new_short, new_long) if w <= h else (new_long, new_short)
    rgb = rgb.resize(size, Image.Resampling.BILINEAR)
    w, h = rgb.size
    top, left = int(round((h - crop) / 2.0)), int(round((w - crop) / 2.0))
    return np.asarray(rgb.crop((left, top, left + crop, top + crop)))


def mean_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())
