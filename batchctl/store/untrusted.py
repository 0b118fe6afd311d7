"""Reading files that someone else may have written (a dataset's documents, a work folder's
journal and state, a record, the build info): regular files only, bounded in size, and JSON
bounded in depth, so no planted file can block a read for ever (a FIFO), fill memory (a device,
a huge file) or crash the parser (`RecursionError` on deeply nested arrays is not a ValueError)."""

from __future__ import annotations

import errno
import io
import json
import os
import stat
from typing import Any

DOCUMENT_BYTES = 64 * 2**20  # a `zarr.json`, the build info, state.json: a few MB even for a large dataset
LOG_BYTES = 4 * 2**30  # the journal and the record: a line per batch


class NotRegularFile(OSError):
    """A FIFO, socket, device or folder where a file was expected."""


def open_regular(path: str | os.PathLike[str], *, follow: bool = True) -> io.BufferedReader:
    """A regular file opened for reading without blocking (a FIFO's open would wait for a
    writer); anything else is refused (`NotRegularFile`); `follow=False` refuses a symbolic link."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotRegularFile(errno.EINVAL, "not a regular file", os.fspath(path))
    return os.fdopen(fd, "rb")


def read_regular(path: str | os.PathLike[str], limit: int = DOCUMENT_BYTES, *, follow: bool = True) -> bytes:
    """A regular file's bytes (`open_regular`), refused when larger than `limit`."""
    with open_regular(path, follow=follow) as file:
        if os.fstat(file.fileno()).st_size > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", os.fspath(path))
        data = file.read(limit + 1)
        if len(data) > limit:  # it grew since
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", os.fspath(path))
        return data


def parse_json(raw: bytes | str) -> Any:
    """JSON, or a ValueError: also for nesting deeper than the interpreter's recursion limit
    (json raises RecursionError there, which no caller expects)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deeply") from None
