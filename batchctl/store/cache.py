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

A cache is only ever an optimisation: a failure to cache (the folder deleted, the disk full, the
limit held by other processes' writes in flight) is not an error; what was fetched is used.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from batchctl.errors import UsageError

LEDGER = "ledger.sqlite3"
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


class ChunkCache:
    """Files of one dataset version in a shared cache folder, at most `limit` bytes of files in
    all (every version and process together)."""

    def __init__(self, folder: str | os.PathLike[str], limit: int | str | None, url: str, version: str) -> None:
        self.folder = Path(folder).expanduser().resolve()
        self.url, self.version = url, version
        self._lock = threading.RLock()  # the loader's threads share the connection: one transaction at a time
        self._pid = os.getpid()
        self._open_folder()
        if limit is None:
            limit = int(shutil.disk_usage(self.folder).free * DEFAULT_SHARE)
        self.limit = parse_size(limit, "cache_limit")
        self._drop_other_versions()

    # the ledger -----------------------------------------------------------------------------

    def _open_folder(self) -> None:
        """The folder and its ledger, made if missing (also after someone deleted them)."""
        try:
            (self.folder / "data").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"cache_dir {self.folder} cannot be made ({exc.strerror})") from None
        self._db = sqlite3.connect(self.folder / LEDGER, timeout=60, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA synchronous=OFF")  # a cache: a ledger lost with the machine is rebuilt empty
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS entries (name TEXT PRIMARY KEY, url TEXT, version TEXT, "
            "bytes INTEGER, used INTEGER, owner INTEGER, ready INTEGER)"
        )
        self._db.execute("CREATE INDEX IF NOT EXISTS by_use ON entries (used)")
        self._ledger_inode = os.stat(self.folder / LEDGER).st_ino

    @contextlib.contextmanager
    def _ledger(self) -> Iterator[sqlite3.Connection]:
        """A write transaction on the ledger (one process at a time), reopened first if the
        folder was deleted or replaced since."""
        if self._pid != os.getpid():  # forked (a DataLoader worker): SQLite connections do not cross a fork
            self._pid, self._lock = os.getpid(), threading.RLock()
            self._open_folder()
        try:
            current = os.stat(self.folder / LEDGER).st_ino
        except FileNotFoundError:
            current = None
        with self._lock:
            if current != self._ledger_inode:
                self._db.close()
                self._open_folder()
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _drop_other_versions(self) -> None:
        """Entries of this URL written by another version: never served again, so freed now."""
        with self._ledger() as db:
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
        return self.folder / "data" / name

    def get(self, key: str) -> bytes | None:
        """The cached bytes of `key`, or None; a hit counts as a use (it is evicted last)."""
        name = self._name(key)
        try:
            data = self._path(name).read_bytes()
        except OSError:
            return None
        with contextlib.suppress(sqlite3.Error, OSError), self._ledger() as db:
            db.execute("UPDATE entries SET used = ? WHERE name = ?", (time.time_ns(), name))
        return data

    def put(self, key: str, data: bytes) -> None:
        """Keep `data` as `key`, evicting the least recently used files to stay within the limit;
        nothing is kept when the rest of the limit is held by writes in flight."""
        name = self._name(key)
        try:
            if not self._reserve(name, len(data)):
                return
            partial = self._path(f"{name}.{os.getpid()}.partial")
            partial.write_bytes(data)
            partial.replace(self._path(name))
            with self._ledger() as db:
                if not db.execute("UPDATE entries SET ready = 1 WHERE name = ?", (name,)).rowcount:
                    self._path(name).unlink(missing_ok=True)  # the folder was deleted and made again meanwhile
        except (sqlite3.Error, OSError):
            return  # the folder deleted under us, a full disk: the fetched bytes are used uncached

    def _reserve(self, name: str, nbytes: int) -> bool:
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
                "INSERT INTO entries VALUES (?, ?, ?, ?, ?, ?, 0)",
                (name, self.url, self.version, nbytes, time.time_ns(), os.getpid()),
            )
        return True

    def discard(self, key: str) -> None:
        """Forget `key` (its file failed its checksum): the next read fetches it again."""
        with contextlib.suppress(sqlite3.Error, OSError), self._ledger() as db:
            self._delete(db, self._name(key))

    def _delete(self, db: sqlite3.Connection, name: str) -> None:
        """A file and its row, inside a ledger transaction (a writer's partial file too)."""
        owner = db.execute("SELECT owner FROM entries WHERE name = ?", (name,)).fetchone()
        self._path(name).unlink(missing_ok=True)
        if owner is not None:
            self._path(f"{name}.{owner[0]}.partial").unlink(missing_ok=True)
        db.execute("DELETE FROM entries WHERE name = ?", (name,))

    def held_bytes(self) -> int:
        """The bytes the ledger accounts for (files written and being written)."""
        with self._ledger() as db:
            return int(db.execute("SELECT COALESCE(SUM(bytes), 0) FROM entries").fetchone()[0])

    def close(self) -> None:
        self._db.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
