"""Preprocessors used by the tests as `--preprocess tests/plugins.py:NAME` (a file plugin)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from batchctl.preprocess import ragged, takes
from batchctl.preprocess.image import preprocess_image


def slow_image(path: Path, delay: float = 0.05, crop: int = 32) -> dict[str, np.ndarray]:
    """The image preprocessing, small and slowed down, so a build lasts long enough to interrupt."""
    time.sleep(delay)
    return preprocess_image(path, resize=crop, crop=crop)


def crash_on(path: Path, name: str = "", crop: int = 32) -> dict[str, np.ndarray]:
    """Kills its own worker process (as the OOM killer or a decoder segfault would) on one file."""
    if path.name == name:
        os.kill(os.getpid(), 9)
    return preprocess_image(path, resize=crop, crop=crop)


def raises_for_bad(path: Path) -> dict[str, np.ndarray]:
    """One float32 vector from the file's bytes; a file named bad.* raises."""
    if path.stem == "bad":
        raise ValueError(f"{path.name} is marked bad")
    data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
    return {"vec": data[:8].astype(np.float32), "length": len(data)}


def shape_changes(path: Path) -> dict[str, np.ndarray]:
    """Shape (4,) for every file but odd.bin, which gives (5,)."""
    return {"vec": np.full(5 if path.name == "odd.bin" else 4, len(path.name), np.int32)}


def reserved_name(path: Path) -> dict[str, np.ndarray]:
    """Uses a field name batchctl keeps for itself."""
    return {"label": np.zeros(2, np.int64)}


def text_field(path: Path) -> dict[str, object]:
    """A caption as a str: no field holds text."""
    return {"x": np.zeros(2, np.float32), "caption": "a dog"}


def dict_field(path: Path) -> dict[str, object]:
    """Boxes as a nested dict."""
    return {"x": np.zeros(2, np.float32), "objects": {"bbox": [1, 2, 3, 4], "category": 0}}


def ragged_named(path: Path) -> dict[str, np.ndarray]:
    """A name as batchctl names a ragged field's arrays."""
    return {"x.offsets": np.zeros(2, np.int64)}


def constant_field(path: Path) -> dict[str, np.ndarray]:
    """The fixed preprocessor: one numeric field."""
    return {"x": np.zeros(2, np.float32)}


def image_and_pid(path: Path, crop: int = 32) -> dict[str, np.ndarray | int]:
    """The image plus the pid of the process that preprocessed it (which Dask worker did the work)."""
    return {**preprocess_image(path, resize=crop, crop=crop), "pid": os.getpid()}


def die_once(path: Path, name: str = "", marker: str = "", crop: int = 32) -> dict[str, np.ndarray]:
    """Kills its own process on file `name` the first time only (`marker` remembers): a lost
    Dask worker whose task must be run again elsewhere."""
    if path.name == name and not os.path.exists(marker):
        Path(marker).touch()
        os.kill(os.getpid(), 9)
    return preprocess_image(path, resize=crop, crop=crop)


def big_endian(path: Path) -> dict[str, np.ndarray]:
    """A big-endian float field (some decoders give them), the file name's length six times."""
    return {"be": np.full(6, len(path.name), dtype=">f4")}


@takes("*.bin")
def bin_length(path: Path, scale: int = 1) -> dict[str, np.ndarray]:
    """Declares its files: only `.bin` files are samples (a README.md beside them is not)."""
    return {"length": np.int64(path.stat().st_size * scale)}


def library_threads(path: Path) -> dict[str, np.ndarray]:
    """The thread counts BLAS and OpenMP were given in the worker's environment (0: none given)."""
    names = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
    return {"threads": np.array([int(os.environ.get(name, "0")) for name in names], np.int32)}


@takes("*.txt")
def tokens(path: Path) -> dict[str, np.ndarray]:
    """Byte tokens of the whole file: outputs that vary in length (no fixed shape)."""
    return {"tokens": np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.int32)}


@takes("*.txt")
@ragged("tokens", "boxes")
def ragged_tokens(path: Path, delay: float = 0.0) -> dict[str, np.ndarray]:
    """A document's bytes as tokens `(n,)` int32 (n = its size, 0 for an empty file) and
    `n % 5` boxes `(n % 5, 4)` float32, plus its length as a fixed field; a file named
    wrong.txt gives int64 tokens (not the dataset's dtype)."""
    time.sleep(delay)
    data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
    tokens = data.astype(np.int64 if path.name == "wrong.txt" else np.int32)
    boxes = np.arange(len(data) % 5 * 4, dtype=np.float32).reshape(-1, 4) + len(data)
    return {"tokens": tokens, "boxes": boxes, "length": np.int64(len(data))}


@takes("*.txt")
@ragged("points")
def ragged_points(path: Path) -> dict[str, np.ndarray]:
    """A document's bytes as points `(n,)` float32; a file named plane.txt gives `(n, 2)` rows."""
    data = np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.float32)
    return {"points": data.reshape(-1, 2) if path.name == "plane.txt" else data}
