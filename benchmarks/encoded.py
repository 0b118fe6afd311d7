"""Side by side in one run: encoded images against stored pixels, and ragged fields.

- 2,400 photos (real ones where scikit-image and scikit-learn are installed, as the `real_photos`
  section makes them; else generated): built as stored 224 px pixels (the default) and as
  `--store jpeg` (longer side 512, quality 90): the datasets' bytes, and the source photos'.
- One epoch of RandomResizedCrop(224) + a flip, batch 64 (the second of two where a process
  keeps its workers): batchctl's loader decoding in its threads; `IterableBatches` with 2
  DataLoader workers; a torchvision-style ImageFolder + RandomResizedCrop DataLoader over the
  original photos with 2 workers (benchmarks/read_peers.py: torchvision's, or the same work on
  PIL where its wheel does not load); and, for scale, stored pixels read by the loader.
- Ragged tokens: a plugin giving 10 to 2,000 int32 tokens a file, read with `ragged="list"` and
  `"pad"`, against the same tokens padded to 2,000 in a fixed field with their length.

    python benchmarks/run.py --only encoded
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import batchctl

HERE = Path(__file__).resolve().parent
ROUNDS = 2  # alternated: this shared machine's speed moves from one run to the next
TOKEN_FILES = 8000
MAX_TOKENS = 2000

TOKENS_PLUGIN = """
import numpy as np
from batchctl.preprocess import ragged

@ragged("tokens")
def tokens(path):
    return {"tokens": np.fromfile(path, dtype="<i4")}

def padded(path, width: int = WIDTH):
    ids = np.fromfile(path, dtype="<i4")
    out = np.zeros(width, np.int32)
    out[: len(ids)] = ids
    return {"tokens": out, "length": np.int64(len(ids))}
""".replace("WIDTH", str(MAX_TOKENS))


def bench_encoded(root: Path, results: dict[str, Any], build_cmd: Callable[..., list[str]]) -> None:
    photos = root / "encoded-photos"
    kind = _make_photos(photos)
    pixels, jpeg = root / "pixels.zarr", root / "jpeg.zarr"
    subprocess.run(build_cmd(photos, pixels, "--batch-size", "64"), check=True, capture_output=True)
    subprocess.run(build_cmd(photos, jpeg, "--batch-size", "64", "--store", "jpeg"), check=True, capture_output=True)
    sizes = {name: _bytes(path) for name, path in (("source", photos), ("pixels", pixels), ("jpeg", jpeg))}
    figures: dict[str, Any] = {
        "photos": f"{batchctl.open(jpeg).num_samples} {kind} photos",
        "bytes": sizes,
        "jpeg_vs_pixels": round(sizes["jpeg"] / sizes["pixels"], 3),
        "jpeg_vs_source": round(sizes["jpeg"] / sizes["source"], 3),
    }
    rates: dict[str, list[float]] = {}
    runs = {
        "batchctl loader, threads (RandomResizedCrop 224 + flip)": ("loader-rrc", jpeg, 2),
        "batchctl IterableBatches, 2 DataLoader workers (RandomResizedCrop 224 + flip)": ("batchctl-rrc", jpeg, 2),
        "torchvision-style ImageFolder + RandomResizedCrop, 2 DataLoader workers": ("torchvision-rrc", photos, 2),
    }
    standin = False
    for _ in range(ROUNDS):
        for name, (mode, path, workers) in runs.items():
            rate, said = _peer(mode, path, workers)
            standin = standin or "STANDIN" in said
            rates.setdefault(name, []).append(rate)
        rates.setdefault("stored 224 px pixels, batchctl loader (no decoding)", []).append(_pixels_rate(pixels))
    peer = statistics.median(rates["torchvision-style ImageFolder + RandomResizedCrop, 2 DataLoader workers"])
    figures["images_per_s"] = {name: round(statistics.median(found), 1) for name, found in rates.items()}
    figures["vs_torchvision_style"] = {
        name: round(statistics.median(found) / peer, 2) for name, found in rates.items() if "batchctl" in name
    }
    figures["torchvision"] = "PIL stand-in (its wheel does not load here)" if standin else "torchvision"
    results["encoded_images"] = figures
    results["ragged_tokens"] = _ragged_tokens(root, build_cmd)


def _make_photos(folder: Path) -> str:
    try:
        from real_photos import make_real_photos

        make_real_photos(folder)
        return "real"
    except ImportError:
        from batchctl.synthetic import make_image_folder

        make_image_folder(folder, 2400, sides=(300, 900))
        return "generated"


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _peer(mode: str, path: Path, workers: int) -> tuple[float, str]:
    proc = subprocess.run(
        [sys.executable, str(HERE / "read_peers.py"), mode, str(path), str(workers), "64"],
        capture_output=True,
        text=True,
        check=True,
    )
    rate = float(next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("RATE")))
    return rate, proc.stdout


def _pixels_rate(path: Path) -> float:
    ds = batchctl.open(path)
    for _ in range(2):  # the second epoch: the page cache warm, as for the others
        images, start = 0, time.perf_counter()
        for batch in ds.loader(batch_size=64, mix=16):
            images += len(batch["image"])
        rate = images / (time.perf_counter() - start)
    return rate


def _ragged_tokens(root: Path, build_cmd: Callable[..., list[str]]) -> dict[str, Any]:
    docs = root / "token-docs"
    docs.mkdir()
    rng = np.random.default_rng(46)
    total = 0
    for i in range(TOKEN_FILES):
        ids = rng.integers(0, 50_000, int(rng.integers(10, MAX_TOKENS + 1)), dtype=np.int32)
        ids.astype("<i4").tofile(docs / f"doc{i:05d}.bin")
        total += len(ids)
    plugin = root / "token_plugins.py"
    plugin.write_text(TOKENS_PLUGIN)
    ragged_out, zstd_out, padded_out = root / "ragged.zarr", root / "ragged-zstd.zarr", root / "padded.zarr"
    for out, fn, extra in (
        (ragged_out, "tokens", ()),
        (zstd_out, "tokens", ("--compression", "zstd")),
        (padded_out, "padded", ()),
    ):
        cmd = build_cmd(docs, out, "--batch-size", "64", "--preprocess", f"{plugin}:{fn}", *extra)
        subprocess.run(cmd, check=True, capture_output=True)
    rates: dict[str, list[float]] = {}
    for _ in range(ROUNDS):
        for mode in ("list", "pad"):
            rates.setdefault(f'ragged, ragged="{mode}"', []).append(_rows_rate(ragged_out, {"ragged": mode}))
        rates.setdefault('ragged, --compression zstd, ragged="list"', []).append(_rows_rate(zstd_out, {}))
        rates.setdefault("padded to 2,000 in a fixed field (+ length)", []).append(_rows_rate(padded_out, {}))
    padded = statistics.median(rates["padded to 2,000 in a fixed field (+ length)"])
    return {
        "files": TOKEN_FILES,
        "mean_tokens": round(total / TOKEN_FILES, 1),
        "bytes": {"ragged": _bytes(ragged_out), "ragged_zstd": _bytes(zstd_out), "padded": _bytes(padded_out)},
        "rows_per_s": {name: round(statistics.median(found), 1) for name, found in rates.items()},
        "vs_padded": {name: round(statistics.median(found) / padded, 2) for name, found in rates.items()},
    }


def _rows_rate(path: Path, options: dict[str, Any]) -> float:
    ds = batchctl.open(path)
    for _ in range(2):
        rows, start = 0, time.perf_counter()
        for batch in ds.loader(batch_size=64, mix=16, **options):
            rows += len(batch["source"])
        rate = rows / (time.perf_counter() - start)
    return rate
