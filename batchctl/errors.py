"""One error hierarchy: the library raises these, only the CLI prints them and picks exit codes."""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchctl.report import BuildReport


class Signalled(BaseException):
    """SIGINT or SIGTERM reached the parent; a BaseException so no `except Exception` eats it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_received: list[int] = []  # stop signals received and not yet acted on


def raise_signalled(signum: int, frame: object = None) -> None:
    """The SIGINT/SIGTERM handler: note the signal, then raise it. The note outlives the raise,
    which library code can swallow (a `Signalled` wrapped by Python, then caught as an
    Exception): `check_signalled` at the next checkpoint raises it again."""
    _received.append(signum)
    raise Signalled(signum)


def quiet_unraisable_signals() -> None:
    """Let a `Signalled` that Python cannot propagate pass without a traceback.

    A signal whose handler raises while Python runs a finalizer (a `__del__`, a weakref callback,
    an atexit function) is reported as "Exception ignored in ..." with its traceback on stderr, and
    dropped. It was noted first (`raise_signalled`), and the next checkpoint acts on it, so there
    is nothing to report. Any other unraisable exception goes to the hook that was there before."""
    previous = sys.unraisablehook
    if getattr(previous, "batchctl_quiet", False):
        return

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, Signalled):
            return
        previous(unraisable)

    hook.batchctl_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def note_signal(signum: int) -> None:
    """A signal held back for now (`signals_deferred`): acted on at the next checkpoint."""
    _received.append(signum)


def check_signalled() -> None:
    """A checkpoint: raise the first stop signal received and not yet acted on."""
    if _received:
        raise Signalled(_received[0])


def signal_handled() -> None:
    """The stop signals received so far have ended what they were meant to end."""
    _received.clear()


def signalled_in(exc: BaseException) -> Signalled | None:
    """The `Signalled` an exception is, or was raised from: Python wraps an exception raised in
    some places (3.11: a RuntimeError for one raised during a class's `__set_name__`, which a
    signal during an import can be), and the interrupt must still end the command as one."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, Signalled):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


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
