"""A preprocessor for benchmarks/interrupts.py: the image preprocessing, each call logged (one
line appended per file to $BATCHCTL_BENCH_COUNT), so the files preprocessed over runs that were
killed outright, which write no report, can be counted."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from batchctl.preprocess.image import preprocess_image


def counted_image(path: Path) -> dict[str, np.ndarray]:
    sample = preprocess_image(path)
    with open(os.environ["BATCHCTL_BENCH_COUNT"], "a", encoding="utf-8") as log:
        log.write(f"{path.name}\n")  # one write of a short line to an O_APPEND file: whole lines
    return sample
