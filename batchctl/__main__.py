"""`python -m batchctl` and the `batchctl` console script."""

import signal
import sys

from batchctl.errors import Signalled, quiet_unraisable_signals, raise_signalled, signalled_in


def main() -> None:
    # First of all, so that a SIGINT or SIGTERM at any moment ends the command through one path
    # (exit 130/143, no traceback); the build turns it into an orderly stop of its processes.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, raise_signalled)
    quiet_unraisable_signals()
    try:
        from batchctl.cli import run
    except (Signalled, Exception) as exc:  # a signal while still importing (perhaps wrapped)
        signalled = signalled_in(exc)
        if signalled is None:
            raise
        sys.exit(128 + signalled.signum)
    run()


if __name__ == "__main__":
    main()
