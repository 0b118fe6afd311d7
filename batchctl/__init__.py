"""batchctl: preprocess a folder of files once, offline, into sharded Zarr v3 batches.

Names are imported lazily so that `batchctl` on the command line starts fast and a Ctrl-C during
start-up never shows a traceback.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from batchctl.version import __version__ as __version__

_EXPORTS = {
    "build": "batchctl.build",
    "BuildOptions": "batchctl.build",
    "open": "batchctl.read.reader",
    "Dataset": "batchctl.read.reader",
    "mix": "batchctl.read.mixture",
    "BuildReport": "batchctl.report",
    "BatchctlError": "batchctl.errors",
    "BuildFailed": "batchctl.errors",
    "BuildInterrupted": "batchctl.errors",
    "DatasetReplacedError": "batchctl.errors",
    "FormatError": "batchctl.errors",
    "IncompleteDatasetError": "batchctl.errors",
    "LockedError": "batchctl.errors",
    "ResumeMismatchError": "batchctl.errors",
    "StoreError": "batchctl.store.storage",
    "UsageError": "batchctl.errors",
}

__all__ = [
    "BatchctlError",
    "BuildFailed",
    "BuildInterrupted",
    "BuildOptions",
    "BuildReport",
    "Dataset",
    "DatasetReplacedError",
    "FormatError",
    "IncompleteDatasetError",
    "LockedError",
    "ResumeMismatchError",
    "StoreError",
    "UsageError",
    "build",
    "mix",
    "open",
]

if TYPE_CHECKING:
    from batchctl.build import BuildOptions, build
    from batchctl.errors import (
        BatchctlError,
        BuildFailed,
        BuildInterrupted,
        DatasetReplacedError,
        FormatError,
        IncompleteDatasetError,
        LockedError,
        ResumeMismatchError,
        UsageError,
    )
    from batchctl.read.mixture import mix
    from batchctl.read.reader import Dataset, open
    from batchctl.report import BuildReport
    from batchctl.store.storage import StoreError


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'batchctl' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
