"""Reading speed: every batch in order and shuffled, against np.load of the same bytes from one
.npy file (the practical limit on this machine)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import batchctl
from batchctl.synthetic import make_image_folder


def bench_read(root: Path, results: dict[str, Any], build_cmd: Callable[..., list[str]], images: int = 1024) -> None:
    src = root / "read-images"
    make_image_folder(src, images, sides=(260, 400))
    out = root / "read.zarr"
    subprocess.run(build_cmd(src, out, "--batch-size", "64"), check=True)
    ds = batchctl.open(out)
    whole = np.concatenate([ds[i]["image"] for i in range(len(ds))])
    npy = root / "images.npy"
    np.save(npy, whole)
    nbytes = whole.nbytes

    def rate(fn: Any, repeat: int = 3) -> float:
        # no writeback of the dataset or of images.npy left running under the measurement
        # (without this the first figure measured, sequential, came out 0.63-1.05x of np.load)
        os.sync()
        best = float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        return best

    limit = rate(lambda: np.load(npy))
    results["read"] = _read_rates(ds, nbytes, limit, rate)
    # the default `auto` stores these pixels raw; the same batches with zstd, for what it costs
    packed = root / "read-zstd.zarr"
    subprocess.run(build_cmd(src, packed, "--batch-size", "64", "--compression", "zstd"), check=True)
    results["read_zstd"] = _read_rates(batchctl.open(packed), nbytes, limit, rate)


def _read_rates(ds: batchctl.Dataset, nbytes: int, limit: float, rate: Callable[..., float]) -> dict[str, Any]:
    sequential = rate(lambda: [b["image"] for b in ds.iter_batches(prefetch=2)])
    shuffled = rate(lambda: [b["image"] for b in ds.iter_batches(shuffle=True, seed=1, prefetch=2)])
    return {
        "samples": ds.num_samples,
        "bytes": nbytes,
        "np_load_mb_s": round(nbytes / limit / 1e6, 1),
        "sequential_mb_s": round(nbytes / sequential / 1e6, 1),
        "sequential_samples_s": round(ds.num_samples / sequential, 1),
        "shuffled_mb_s": round(nbytes / shuffled / 1e6, 1),
        "shuffled_samples_s": round(ds.num_samples / shuffled, 1),
        "sequential_vs_np_load": round(limit / sequential, 3),
        "shuffled_vs_np_load": round(limit / shuffled, 3),
    }
