"""`python -m batchctl` and the `batchctl` console script."""

import sys


def main() -> None:
    try:
        from batchctl.cli import run
    except KeyboardInterrupt:  # Ctrl-C while still importing: exit as interrupted, quietly
        sys.exit(130)
    run()


if __name__ == "__main__":
    main()
