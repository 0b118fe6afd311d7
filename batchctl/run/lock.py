"""The build lock: one build of an OUTPUT at a time, taken over from a build that died."""

from __future__ import annotations

import errno
import fcntl
import os
import pwd
import stat
from pathlib import Path

from batchctl.errors import LockedError, UsageError


class LockUnavailable(UsageError):
    """The lock cannot be taken here: OUTPUT's folder is not writable (read-only, or not ours), or
    another user's lock file is there (an up-to-date rerun, which replaces nothing, needs none)."""


def _user(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name}"
    except KeyError:
        return f"uid {uid}"


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
            if exc.errno in (errno.EACCES, errno.EPERM) and os.path.lexists(self.path):
                self._refuse_others_lock()
            raise LockUnavailable(
                f"cannot create the lock {self.path} ({exc.strerror}): OUTPUT's folder must be writable."
            ) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            os.close(fd)
            raise UsageError(f"the lock {self.path} is not a plain file of its own; remove it.")
        return fd

    def _refuse_others_lock(self) -> None:
        """The lock file is there and not ours to write: say whose build holds it, or that nobody does."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            owner = "another user"
        else:
            try:
                owner = _user(os.fstat(fd).st_uid)
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise LockedError(
                    f"another build of this output is running (process {holder} of {owner} holds {self.path}); "
                    "wait for it to finish or stop it."
                ) from None
            finally:
                os.close(fd)
        raise LockUnavailable(
            f"the lock {self.path} belongs to {owner} and no build holds it; ask them to remove it, "
            "or choose another OUTPUT."
        )

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> BuildLock:
        return self if self.fd is not None else self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
