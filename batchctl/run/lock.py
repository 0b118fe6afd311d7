"""The build lock: one build of an OUTPUT at a time, taken over from a build that died."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

from batchctl.errors import LockedError, UsageError


class BuildLock:
    """An flock on the lock file: the kernel drops it when the holder dies, so a lock left by a
    killed build is simply taken over. The file records the holder's pid for the message.

    OUTPUT may well sit in a shared folder such as /tmp, so the lock is never a symlink (someone
    could plant one to make us truncate a file of ours) nor anything but a plain file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None

    def acquire(self) -> BuildLock:
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise LockedError(
                    f"another build of this output is running (process {holder} holds {self.path}); "
                    "wait for it to finish or stop it."
                ) from None
            if os.path.lexists(self.path) and os.lstat(self.path).st_ino == os.fstat(fd).st_ino:
                break
            os.close(fd)  # the file was replaced between open and flock: lock the new one
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def _open(self) -> int:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UsageError(
                    f"the lock {self.path} is a symbolic link; batchctl will not follow it: remove it."
                ) from None
            raise UsageError(
                f"cannot create the lock {self.path} ({exc.strerror}): OUTPUT's folder must be writable."
            ) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            os.close(fd)
            raise UsageError(f"the lock {self.path} is not a plain file of its own; remove it.")
        return fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> BuildLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
