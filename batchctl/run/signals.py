"""The stop signals' state, in one place: SIGINT and SIGTERM reach the parent of a build as
`Signalled` (a BaseException, so no `except Exception` eats it); a raise that library code
swallowed is remembered and raised again at the next checkpoint (`check_signalled`), and a signal
held back for a moment (`batchctl.run.processes.signals_deferred`) waits there too. Handlers are
installed by `batchctl.run.processes`; the CLI and `build()` turn a `Signalled` into exit codes
130 / 143 or `BuildInterrupted`."""

from __future__ import annotations

import sys
from typing import Any


class Signalled(BaseException):
    """SIGINT or SIGTERM reached the parent; a BaseException so no `except Exception` eats it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_received: list[int] = []  # stop signals received and not yet acted on
_published: list[bool] = [False]  # the build's dataset is published: a stop signal changes nothing now


def raise_signalled(signum: int, frame: object = None) -> None:
    """The SIGINT/SIGTERM handler: note the signal, then raise it. The note outlives the raise,
    which library code can swallow (a `Signalled` wrapped by Python, then caught as an
    Exception): `check_signalled` at the next checkpoint raises it again. Once the build has
    published its dataset, a stop signal is dropped: the command ends as it would (exit 0, the
    dataset complete), not as an interruption of work that is done."""
    if _published[0]:
        return
    _received.append(signum)
    raise Signalled(signum)


def published(done: bool) -> None:
    """Say whether the build under way has published its dataset (`raise_signalled`)."""
    _published[0] = done


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
