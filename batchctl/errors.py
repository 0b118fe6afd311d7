"""One error hierarchy: the library raises these, only the CLI prints them and picks exit codes."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchctl.report import BuildReport


class BatchctlError(Exception):
    """Base of every error batchctl raises for a user's mistake or a failed build.

    Raised in a PyTorch DataLoader worker, an error reaches the main process made again from one
    message, torch's "Caught X in DataLoader worker process N.\nOriginal Traceback ...": that is
    cut back to its own line, and says which worker, so the user reads one line there too."""

    def __init__(self, *args: object) -> None:
        if len(args) == 1 and isinstance(args[0], str):
            args = (_own_line(args[0]),)
        super().__init__(*args)


def _own_line(message: str) -> str:
    """The error's own message out of torch's re-raised worker exception text, or `message`."""
    head, _, rest = message.partition("\n")
    if not (head.startswith("Caught ") and rest.startswith("Original Traceback")):
        return message
    last = rest.rstrip().rsplit("\n", 1)[-1]
    own = last.split(": ", 1)[1] if ": " in last else last
    where = head.split(" ", 2)[-1].rstrip(".")  # "in DataLoader worker process 0"
    return f"{own} ({where})"


class UsageError(BatchctlError, ValueError):
    """Bad options or arguments, found before any work starts (CLI exit code 2)."""


class PreprocessorError(UsageError):
    """The preprocessor returned what no dataset holds (text, a dict, a name batchctl keeps for
    itself): its fault, not one file's, so the build stops at the first file, in one line."""


class FormatError(BatchctlError, ValueError):
    """A path is not a batchctl dataset, or its metadata breaks docs/format.md."""


class DatasetReplacedError(FormatError):
    """A build replaced the dataset after it was opened: open it again to read the new one."""


class IncompleteDatasetError(BatchctlError):
    """The dataset was not finished: reading it would give a partial result."""


class LockedError(BatchctlError):
    """Another live build holds the output's lock."""


class ResumeMismatchError(UsageError):
    """An interrupted build was started with other options than the ones given now."""


class PipelineError(Exception):
    """A fatal problem while building (a child died, the collator failed, no sample came out):
    the build turns it into `BuildFailed` with its report."""


class BuildFailed(BatchctlError):
    """The build ended without a complete dataset; `report` says how far it got."""

    def __init__(self, message: str, report: BuildReport) -> None:
        super().__init__(message)
        self.report = report


class BuildInterrupted(BatchctlError):
    """SIGINT or SIGTERM stopped the build; what was written durably is kept for resuming."""

    def __init__(self, signum: int, report: BuildReport) -> None:
        super().__init__(f"interrupted by signal {signum}")
        self.signum = signum
        self.report = report


def warn(message: str) -> None:
    """One warning line on stderr (`batchctl: warning: ...`) through the `batchctl` logger: a
    program that configures logging decides where it goes."""
    logging.getLogger("batchctl").warning("batchctl: warning: %s", message)
