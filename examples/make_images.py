"""Generate a small photo-like image folder with class sub-folders (used by `make demo`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from batchctl.synthetic import make_image_folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--count", type=int, default=200)
    args = parser.parse_args()
    paths = make_image_folder(args.folder, args.count)
    print(f"wrote {len(paths)} images under {args.folder}")


if __name__ == "__main__":
    main()
