"""A bounded cache on local disk of what a reader fetched from an object store (stored chunks and
shard indexes, as stored: their checksums are checked again on every read from the cache).

Several processes share one folder (DataLoader workers, the ranks of a node): the folder's
ledger, an SQLite database beside the files, holds one row per file with its size and its last
use, and every change to the files is made inside one of its write transactions, which SQLite
serialises across processes. A file's bytes are reserved in the ledger before the file is
written, so the files on disk never add up to more than the limit; the least recently used are
deleted to make room. Entries are keyed by the dataset's version (its `build_id`): after a
rebuild at the URL nothing of the old version is served, and the old version's entries of that
URL are dropped when the new one is opened.

The cache is a trust boundary (docs/format.md, "The read cache"): a `cache_dir` not owned by the
user, or writable by others, is refused before anything in it is read or deleted; its folders are
0700 and its files 0600. Every file name is derived from (URL, version, key) and checked before it
is opened or deleted, never taken from the ledger as a path. A cached file is served only when its
SHA-256 is the one the ledger recorded when the bytes came from the store (a file swapped for
another chunk of the same length, or crafted with a recomputed crc32c, is fetched again); files
without a row (an emptied ledger) are deleted when the cache is opened, so the limit holds; a
damaged ledger is rebuilt empty, with one warning line, or the reads go uncached.

A cache is only ever an optimisation: a failure to cache (the folder deleted, the disk full, the
limit held by other processes' writes in flight) is not an error; what was fetched is used.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import sqlite3
import stat
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

from batchctl.errors import UsageError, warn

LEDGER = "ledger.sqlite3"
LEDGER_VERSION = 2  # PRAGMA user_version: rows carry the SHA-256 of their file
_NAME = re.compile(r"[0-9a-f]{40}")
_PARTIAL = re.compile(r"([0-9a-f]{40})\.(\d+)\.partial")
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", re.IGNORECASE)
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
DEFAULT_SHARE = 0.5  # of the free space on the cache's disk when no limit is given


def parse_size(value: int | str, what: str) -> int:
    """Bytes from an int or a size string: `20GB`, `512 MiB`, `1.5G`, `4096`."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = _SIZE.fullmatch(value) if isinstance(value, str) else None
    if match is None or float(match[1]) <= 0:
        raise UsageError(f"Expected {what} to be a number of bytes or a size such as '20GB', got {value!r} instead.")
    return int(float(match[1]) * _UNITS[(match[2] or "").lower()])


class LedgerDamaged(Exception):
    """The ledger cannot be used as it is (not a database, damaged, of another layout, not a file)."""


class ChunkCache:
    """Files of one dataset version in a shared cache folder, at most `limit` bytes of files in
    all (every version and process together)."""

    def __init__(self, folder: str | os.PathLike[str], limit: int | str | None, url: str, version: str) -> None:
        self.folder = Path(folder).expanduser().absolute()
        self.url, self.version = url, version
        self._lock = threading.RLock()  # the loader's threads share the connection: one transaction at a time
        self._db: sqlite3.Connection | None = None  # None: reads go uncached (the ledger could not be made)
        self._reopen = False  # forked (a DataLoader worker): this process's own connection is made at first use
        self._ledger_inode: int | None = None
        self._open_folder()
        _OPEN.add(self)
        if limit is None:
            limit = int(shutil.disk_usage(self.folder).free * DEFAULT_SHARE)
        self.limit = parse_size(limit, "cache_limit")
        if self._db is not None:
            self._drop_other_versions()

    # the folder and the ledger ------------------------------------------------------------------

    def _open_folder(self) -> None:
        """The folder and its ledger, made if missing (also after someone deleted them); a folder
        that is not the user's own is refused, a damaged ledger rebuilt."""
        for folder in (self.folder, self.folder / "data"):
            _private_folder(folder)
        try:
            self._db = self._connect()
        except LedgerDamaged as exc:
            self._db = self._rebuild(str(exc))
        if self._db is not None:
            self._sweep()

    def _connect(self) -> sqlite3.Connection:
        """The ledger, checked: a regular file of ours, a sound SQLite database of this layout."""
        path = self.folder / LEDGER
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise LedgerDamaged(f"it cannot be opened ({exc.strerror})") from None
        try:
            st = os.fstat(fd)
        finally:
            os.close(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise LedgerDamaged("it is not a file of yours")
        try:
            db = sqlite3.connect(path, timeout=60, isolation_level=None, check_same_thread=False)
        except sqlite3.Error as exc:
            raise LedgerDamaged(str(exc)) from None
        try:
            self._set_up(db)
        except sqlite3.Error as exc:
            db.close()
            raise LedgerDamaged(str(exc)) from None
        self._ledger_inode = st.st_ino
        return db

    @staticmethod
    def _set_up(db: sqlite3.Connection) -> None:
        db.execute("PRAGMA synchronous=OFF")  # a cache: a ledger lost with the machine is rebuilt empty
        if db.execute("PRAGMA quick_check").fetchone()[0] != "ok":
            raise sqlite3.DatabaseError("the database is damaged")
        version = db.execute("PRAGMA user_version").fetchone()[0]
        tables = db.execute("SELECT count(*) FROM sqlite_master WHERE type = 'table'").fetchone()[0]
        if tables and version != LEDGER_VERSION:
            raise sqlite3.DatabaseError(f"its layout is version {version}, not {LEDGER_VERSION}")
        db.execute("BEGIN IMMEDIATE")
        db.execute(
            "CREATE TABLE IF NOT EXISTS entries (name TEXT PRIMARY KEY, url TEXT, version TEXT, "
            "bytes INTEGER, used INTEGER, owner INTEGER, ready INTEGER, sha256 TEXT)"
        )
        db.execute("CREATE INDEX IF NOT EXISTS by_use ON entries (used)")
        db.execute(f"PRAGMA user_version = {LEDGER_VERSION}")
        db.execute("COMMIT")

    def _rebuild(self, why: str) -> sqlite3.Connection | None:
        """A new, empty ledger in place of a damaged one, and no file it no longer accounts for;
        None (reads go uncached) when that fails too. Says so in one line either way."""
        path = self.folder / LEDGER
        try:
            for side in (path, path.with_name(f"{LEDGER}-journal"), path.with_name(f"{LEDGER}-wal")):
                if side.is_dir() and not side.is_symlink():
                    shutil.rmtree(side)
                else:
                    side.unlink(missing_ok=True)
            db = self._connect()
        except (OSError, LedgerDamaged) as exc:
            warn(f"the read cache's ledger {path} cannot be used ({why}) nor made again ({exc}): reading uncached")
            return None
        warn(f"the read cache's ledger {path} could not be used ({why}): made again, empty")
        return db

    def _sweep(self) -> None:
        """Delete the files of the data folder no row accounts for (an emptied or rebuilt ledger),
        and partial files of writers that are gone: so the limit holds. Other names are not
        batchctl's, and left alone."""
        assert self._db is not None
        with contextlib.suppress(sqlite3.Error, OSError), self._ledger() as db:
            known = {name: owner for name, owner in db.execute("SELECT name, owner FROM entries")}
            for entry in os.scandir(self.folder / "data"):
                if _unaccounted(entry.name, known):
                    os.unlink(entry.path)

    def _forked(self) -> None:
        """In a forked child (a DataLoader worker): SQLite connections do not cross a fork. The
        parent's is kept, never used or closed (closing it would drop this process's SQLite locks
        on the ledger, the new connection's too); the child opens its own at first use, under a
        lock of its own (the parent's may have been held by a thread that does not exist here)."""
        if self._db is not None:
            _INHERITED.append(self._db)
        self._db, self._lock, self._reopen = None, threading.RLock(), True

    @contextlib.contextmanager
    def _ledger(self) -> Iterator[sqlite3.Connection]:
        """A write transaction on the ledger (one process at a time), reopened first if the
        folder was deleted or replaced since, or this is a forked child. Raises sqlite3.Error
        when the cache is off."""
        with self._lock:
            if self._reopen:
                self._reopen = False
                self._open_folder()
            try:
                current = os.stat(self.folder / LEDGER).st_ino
            except OSError:
                current = None
            if current != self._ledger_inode and self._db is not None:
                self._db.close()
                self._open_folder()
            if self._db is None:
                raise sqlite3.OperationalError("the cache is off: its ledger could not be made")
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _drop_other_versions(self) -> None:
        """Entries of this URL written by another version: never served again, so freed now."""
        with contextlib.suppress(sqlite3.Error, OSError), self._ledger() as db:
            stale = db.execute(
                "SELECT name, owner, ready FROM entries WHERE url = ? AND version != ?", (self.url, self.version)
            ).fetchall()
            for name, owner, ready in stale:
                if ready or not _alive(owner):
                    self._delete(db, name)

    # files --------------------------------------------------------------------------------------

    def _name(self, key: str) -> str:
        """A file name for a key of this version (hashed: keys hold field names and URLs)."""
        return hashlib.sha256(f"{self.url}\0{self.version}\0{key}".encode()).hexdigest()[:40]

    def _path(self, name: str) -> Path:
        """A file of the data folder by a name this cache makes: anything else (a name planted in
        the ledger, `../../x`) is refused, so no path outside the folder is ever opened or deleted."""
        if not (_NAME.fullmatch(name) or _PARTIAL.fullmatch(name)):
            raise ValueError(f"{name!r} is not a name of the read cache's")
        return self.folder / "data" / name

    def get(self, key: str) -> bytes | None:
        """The cached bytes of `key`, or None; a hit counts as a use (it is evicted last). Bytes
        whose SHA-256 is not the one recorded when they were fetched are dropped, not served."""
        name = self._name(key)
        try:
            with self._ledger() as db:
                row = db.execute("SELECT bytes, sha256 FROM entries WHERE name = ? AND ready = 1", (name,)).fetchone()
                if row is not None:
                    db.execute("UPDATE entries SET used = ? WHERE name = ?", (time.time_ns(), name))
            if row is None:
                return None
            data = _read_file(self._path(name), int(row[0]))
        except (sqlite3.Error, OSError, ValueError):
            return None
        if hashlib.sha256(data).hexdigest() != row[1]:
            self.discard(key)
            return None
        return data

    def put(self, key: str, data: bytes) -> None:
        """Keep `data` as `key`, evicting the least recently used files to stay within the limit;
        nothing is kept when the rest of the limit is held by writes in flight."""
        name = self._name(key)
        try:
            if not self._reserve(name, len(data), hashlib.sha256(data).hexdigest()):
                return
            partial = self._path(f"{name}.{os.getpid()}.partial")
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as file:
                file.write(data)
            partial.replace(self._path(name))
            with self._ledger() as db:
                if not db.execute("UPDATE entries SET ready = 1 WHERE name = ?", (name,)).rowcount:
                    self._path(name).unlink(missing_ok=True)  # the folder was deleted and made again meanwhile
        except (sqlite3.Error, OSError):
            return  # the folder deleted under us, a full disk: the fetched bytes are used uncached

    def _reserve(self, name: str, nbytes: int, sha256: str) -> bool:
        if nbytes > self.limit:
            return False
        with self._ledger() as db:
            if db.execute("SELECT 1 FROM entries WHERE name = ?", (name,)).fetchone():
                return False  # another reader holds it or is writing it
            held = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM entries").fetchone()[0]
            if held + nbytes > self.limit:
                for victim, size, owner, ready in db.execute(
                    "SELECT name, bytes, owner, ready FROM entries ORDER BY used"
                ).fetchall():
                    if not ready and _alive(owner):
                        continue  # being written
                    self._delete(db, victim)
                    held -= size
                    if held + nbytes <= self.limit:
                        break
            if held + nbytes > self.limit:
                return False
            db.execute(
                "INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?, 0, ?)",
                (name, self.url, self.version, nbytes, time.time_ns(), os.getpid(), sha256),
            )
        return True

    def discard(self, key: str) -> None:
        """Forget `key` (its file failed a check): the next read fetches it again."""
        with contextlib.suppress(sqlite3.Error, OSError), self._ledger() as db:
            self._delete(db, self._name(key))

    def _delete(self, db: sqlite3.Connection, name: str) -> None:
        """A file and its row, inside a ledger transaction (a writer's partial file too). A row
        whose name or owner is not of this cache's making loses only its row."""
        owner = db.execute("SELECT owner FROM entries WHERE name = ?", (name,)).fetchone()
        db.execute("DELETE FROM entries WHERE name = ?", (name,))
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            return
        self._path(name).unlink(missing_ok=True)
        if owner is not None and isinstance(owner[0], int):
            self._path(f"{name}.{owner[0]}.partial").unlink(missing_ok=True)

    def held_bytes(self) -> int:
        """The bytes the ledger accounts for (files written and being written)."""
        with self._ledger() as db:
            return int(db.execute("SELECT COALESCE(SUM(bytes), 0) FROM entries").fetchone()[0])

    def close(self) -> None:
        if self._db is not None:
            self._db.close()


_OPEN: weakref.WeakSet[ChunkCache] = weakref.WeakSet()  # this process's caches, told when it forks
_INHERITED: list[sqlite3.Connection] = []  # a parent's connections in a forked child: kept, never closed


def _after_fork_in_child() -> None:
    for cache in list(_OPEN):
        cache._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _private_folder(folder: Path) -> None:
    """`folder`, made 0700 if missing; refused in one line unless a folder of this user's that
    nobody else can write into (another user could plant a ledger or files there), and not a
    symbolic link (one planted in a shared folder could point the cache, and its chmod, at any
    folder of the user's)."""
    link = UsageError(
        f"cache_dir {folder} is a symbolic link: batchctl will not read, change or delete anything where it "
        "points; give the folder itself"
    )
    if folder.is_symlink():
        raise link
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # (made a link since)
            raise link from None
        raise UsageError(f"cache_dir {folder} cannot be made ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise UsageError(
                f"cache_dir {folder} is not a private folder of yours (owned by you, writable by you alone): "
                "batchctl will not read or delete anything in it; choose another cache_dir"
            )
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o700)  # ours, and nobody else could write into it: what is cached is private too
    finally:
        os.close(fd)


def _unaccounted(name: str, known: dict[str, int]) -> bool:
    """Whether a file of the data folder is one of the cache's that no row (or no live writer) holds."""
    if _NAME.fullmatch(name):
        return name not in known
    partial = _PARTIAL.fullmatch(name)
    return partial is not None and (known.get(partial[1]) != int(partial[2]) or not _alive(int(partial[2])))


def _read_file(path: Path, nbytes: int) -> bytes:
    """A cached file's bytes: a regular file (no link followed) of exactly `nbytes`."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as file:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != nbytes:
            raise OSError(f"{path} is not the file the ledger recorded")
        return file.read(nbytes)


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False  # not a pid of this cache's making
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
