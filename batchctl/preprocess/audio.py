"""Audio (`.wav .flac .ogg`, via soundfile): mono float32 at `sample_rate`, cut into consecutive
`clip_seconds` windows, the last zero-padded; a file of d seconds yields ceil(d / clip) samples.
Other rates are resampled with a polyphase filter (scipy's resample_poly). Long recordings are
split into ranges of clips that workers take independently; each range is resampled on its own,
which is exact when no resampling is needed and differs by the filter's edge transient otherwise."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from batchctl.preprocess.base import Preprocessor

EXTENSIONS = (".wav", ".flac", ".ogg")


def _frames_per_clip(file_rate: int, clip_seconds: float) -> int:
    return max(1, round(file_rate * clip_seconds))


def preprocess_audio(
    path: Path, sample_rate: int = 16000, clip_seconds: float = 1.0, part: tuple[int, int] | None = None
) -> Iterator[dict[str, np.ndarray]]:
    import soundfile as sf

    with sf.SoundFile(path) as audio:
        per_clip = _frames_per_clip(audio.samplerate, clip_seconds)
        clips = math.ceil(audio.frames / per_clip)
        start, stop = part if part is not None else (0, clips)
        audio.seek(start * per_clip)
        frames = audio.read((stop - start) * per_clip, dtype="float32", always_2d=True)
        file_rate = audio.samplerate
    mono = frames.mean(axis=1, dtype=np.float32)
    if file_rate != sample_rate:
        from scipy.signal import resample_poly

        ratio = Fraction(sample_rate, file_rate)
        mono = resample_poly(mono, ratio.numerator, ratio.denominator).astype(np.float32)
    length = round(sample_rate * clip_seconds)
    padded = np.zeros((stop - start) * length, np.float32)
    padded[: min(len(mono), len(padded))] = mono[: len(padded)]
    return ({"audio": clip} for clip in padded.reshape(stop - start, length))


def count_clips(path: Path, sample_rate: int = 16000, clip_seconds: float = 1.0) -> int:
    import soundfile as sf

    info = sf.info(str(path))
    return int(math.ceil(info.frames / _frames_per_clip(info.samplerate, clip_seconds)))


def describe(options: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    rate = options.get("sample_rate")
    attributes = {
        "meaning": "mono waveform, one value per sample instant; 1.0 is the source's full scale",
        "sample_rate": rate,
        "sample_rate_units": "Hz",
        "full_scale": 1.0,
    }
    return {"audio": {"dimension_names": ["time"], "attributes": attributes}}


PREPROCESSOR = Preprocessor(
    name="audio",
    describe=describe,
    code="audio/1",  # raise when the output for the same file and options changes
    fn=preprocess_audio,
    extensions=EXTENSIONS,
    defaults={"sample_rate": 16000, "clip_seconds": 1.0},
    count=count_clips,
)
