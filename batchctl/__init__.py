"""batchctl: preprocess a folder of files once, offline, into sharded Zarr v3 batches."""

__version__ = "0.1.0"

from batchctl.build import BuildOptions, build  # noqa: E402
from batchctl.errors import (  # noqa: E402
    BatchctlError,
    BuildFailed,
    BuildInterrupted,
    FormatError,
    IncompleteDatasetError,
    LockedError,
    ResumeMismatchError,
    UsageError,
)
from batchctl.reader import Dataset, open  # noqa: E402
from batchctl.report import BuildReport  # noqa: E402

__all__ = [
    "BatchctlError",
    "BuildFailed",
    "BuildInterrupted",
    "BuildOptions",
    "BuildReport",
    "Dataset",
    "FormatError",
    "IncompleteDatasetError",
    "LockedError",
    "ResumeMismatchError",
    "UsageError",
    "build",
    "open",
]
