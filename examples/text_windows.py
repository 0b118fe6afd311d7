"""An example plugin: text files -> fixed-length windows of byte tokens.

    batchctl build corpus/ -o corpus.zarr --preprocess examples/text_windows.py:byte_windows \\
        --include '*.txt' --option window=128

Each window is a uint8 array of `window` UTF-8 bytes (the last one zero-padded), so a file of
n bytes yields ceil(n / window) samples, `source_index` numbering them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np


def byte_windows(path: Path, window: int = 64) -> Iterator[dict[str, np.ndarray]]:
    data = np.frombuffer(path.read_bytes(), dtype=np.uint8)
    if data.size == 0:
        raise ValueError("empty text file")
    padded = np.zeros(-(-data.size // window) * window, np.uint8)
    padded[: data.size] = data
    for tokens in padded.reshape(-1, window):
        yield {"tokens": tokens}
