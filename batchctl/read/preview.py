"""Preview: a PNG a person can look at, to see what was built (images in a grid, audio as waveforms)."""

from __future__ import annotations

import io
import math
import os
from collections.abc import Mapping

import numpy as np
from PIL import Image, ImageDraw

from batchctl.errors import UsageError
from batchctl.read.reader import Dataset

TILE = 160
LABEL_H = 16


def preview(
    path: str | os.PathLike[str],
    output: str | os.PathLike[str],
    batch: int = 0,
    count: int = 16,
    storage_options: Mapping[str, object] | None = None,
) -> int | str:
    """Write a grid of the first `count` samples of `batch` to `output` and return how many were
    drawn; a dataset with neither images nor audio has nothing to draw: its rows as a text table.
    `path` is local or a URL (`storage_options` as for `batchctl.open`)."""
    ds = Dataset(path, allow_partial=True, storage_options=storage_options)
    if not 0 <= batch < ds.num_batches:
        raise UsageError(f"Expected --batch between 0 and {ds.num_batches - 1}, got {batch} instead.")
    rows = ds[batch]
    count = min(count, len(rows["source"]))
    captions = [_caption(ds, rows, i) for i in range(count)]
    if "image" in rows and "image" in ds.encodings:  # `--store jpeg`/`png`: each row a picture's bytes
        tiles = [_image_tile(_decoded(rows["image"][i])) for i in range(count)]
    elif "image" in rows:
        tiles = [_image_tile(rows["image"][i]) for i in range(count)]
    elif "audio" in rows:
        tiles = [_waveform_tile(rows["audio"][i]) for i in range(count)]
    else:
        return rows_table(rows, count, captions if ds.classes is not None else None)
    _grid(tiles, captions).save(output)
    return count


def rows_table(rows: dict[str, np.ndarray], count: int, classes: list[str] | None) -> str:
    """The first `count` rows, one line each: source, class, then each field's first values."""
    fields = [name for name in rows if name not in ("source", "source_index", "label")]
    header = ["source", *(["class"] if classes is not None else []), *fields]
    lines = [header]
    for i in range(count):
        cells = [str(rows["source"][i]), *([classes[i]] if classes is not None else [])]
        cells += [_values(rows[name][i]) for name in fields]
        lines.append(cells)
    widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines)


def _values(row: np.ndarray) -> str:
    flat = np.asarray(row).reshape(-1)
    shown = " ".join(f"{v:.4g}" if flat.dtype.kind == "f" else str(v) for v in flat[:6].tolist())
    return f"[{shown}{' ...' if flat.size > 6 else ''}] {tuple(np.shape(row))}" if flat.size != 1 else shown


def _caption(ds: Dataset, rows: dict[str, np.ndarray], i: int) -> str:
    if ds.classes is not None and "label" in rows:
        return ds.classes[int(rows["label"][i])]
    return str(rows["source"][i]).rsplit("/", 1)[-1]


def _decoded(data: np.ndarray) -> np.ndarray:
    with Image.open(io.BytesIO(data.tobytes())) as image:
        return np.asarray(image.convert("RGB"))


def _image_tile(pixels: np.ndarray) -> Image.Image:
    if pixels.ndim == 3 and pixels.shape[0] in (1, 3) and pixels.shape[-1] not in (1, 3):
        pixels = pixels.transpose(1, 2, 0)  # chw layout
    if pixels.dtype != np.uint8:
        low, high = float(pixels.min()), float(pixels.max())
        pixels = ((pixels - low) / (high - low or 1) * 255).astype(np.uint8)
    image = Image.fromarray(pixels.squeeze())
    scale = TILE / max(image.size)  # small crops are enlarged (nearest), large ones shrunk
    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    resample = Image.Resampling.NEAREST if scale > 1 else Image.Resampling.BILINEAR
    return image.resize(size, resample).convert("RGB")


def _waveform_tile(samples: np.ndarray) -> Image.Image:
    tile = Image.new("RGB", (TILE, TILE), "white")
    draw = ImageDraw.Draw(tile)
    wave = samples.reshape(-1).astype(np.float32)
    peak = float(np.abs(wave).max()) or 1.0
    xs = np.linspace(0, len(wave) - 1, TILE).astype(int)
    points = [(x, TILE / 2 - wave[i] / peak * (TILE / 2 - 4)) for x, i in enumerate(xs)]
    draw.line(points, fill=(30, 90, 200))
    return tile


def _grid(tiles: list[Image.Image], captions: list[str]) -> Image.Image:
    columns = math.ceil(math.sqrt(len(tiles)))
    lines = math.ceil(len(tiles) / columns)
    sheet = Image.new("RGB", (columns * TILE, lines * (TILE + LABEL_H)), "white")
    draw = ImageDraw.Draw(sheet)
    for i, (tile, caption) in enumerate(zip(tiles, captions, strict=True)):
        x, y = (i % columns) * TILE, (i // columns) * (TILE + LABEL_H)
        sheet.paste(tile, (x + (TILE - tile.width) // 2, y + (TILE - tile.height) // 2))
        draw.text((x + 4, y + TILE + 2), caption[:24], fill="black")
    return sheet
