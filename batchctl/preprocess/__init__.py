"""Preprocessors: small pluggable units that turn one input file into samples.

A preprocessor is a function `fn(path, **options) -> sample | Iterator[sample]`, a sample being a
dict of field name -> NumPy array (or Python scalar). Built-ins are registered by name here; the
contract is written down in docs/preprocessors.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from batchctl.errors import UsageError

Sample = dict[str, np.ndarray]
PreprocessFn = Callable[..., Any]


@dataclass(frozen=True)
class Preprocessor:
    """A named preprocessing function, the files it takes and its default options."""

    name: str
    fn: PreprocessFn
    extensions: tuple[str, ...] | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)

    def accepts(self, relpath: str) -> bool:
        if self.extensions is None:
            return True
        return relpath.lower().endswith(self.extensions)

    def options(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """Defaults overlaid with the given options, refusing names the preprocessor lacks."""
        unknown = sorted(set(given) - set(self.defaults))
        if unknown and self.defaults:
            raise UsageError(
                f"Preprocessor {self.name!r} takes options {', '.join(sorted(self.defaults))}; "
                f"got {', '.join(unknown)} instead."
            )
        return {**self.defaults, **given}

    def samples(self, path: Path, options: Mapping[str, Any]) -> Iterator[Sample]:
        """Run the function and normalise its result to a stream of samples of arrays."""
        result = self.fn(path, **options)
        stream = [result] if isinstance(result, Mapping) else result
        for raw in stream:
            if not isinstance(raw, Mapping) or not raw:
                raise TypeError(f"preprocessor {self.name} returned {type(raw).__name__}, expected a dict of arrays")
            yield {str(k): np.asarray(v) for k, v in raw.items()}


def resolve(name: str) -> Preprocessor:
    """Look a built-in preprocessor up by name."""
    from batchctl.preprocess import image

    registry = {"image": image.PREPROCESSOR}
    try:
        return registry[name]
    except KeyError:
        raise UsageError(
            f"Expected --preprocess one of {', '.join(sorted(registry))}, got {name!r} instead."
        ) from None
