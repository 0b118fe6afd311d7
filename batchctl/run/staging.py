"""Where a build writes before its dataset is complete, and how it gets into place.

For OUTPUT `dir/data.zarr` a build works in `dir/.data.zarr.batchctl/` (the staging dataset,
its journal and the options it was started with) and holds `dir/.data.zarr.batchctl.lock`
(`batchctl.run.lock`); a complete dataset's record is inside it, `dir/data.zarr/batchctl.record`,
so it travels with the dataset and is published with it.
Only a complete dataset is moved to OUTPUT, by one atomic rename (an atomic exchange when an
older dataset is there), so readers see the old dataset or the new one, never a half-built one.
An object store has neither rename nor append: `RemoteWorkdir` writes the dataset in place and
journals whole objects. Both sit behind one interface, `Workdir`; the journal's lines and their
meaning (`batchctl.store.journal`) are the same for both.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import shutil
import stat
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchctl.errors import UsageError
from batchctl.run.processes import signals_ignored
from batchctl.run.signals import published
from batchctl.store import journal, storage
from batchctl.store.journal import Untrusted
from batchctl.store.metadata import RECORD
from batchctl.store.untrusted import LOG_BYTES, parse_json, read_regular
from batchctl.store.zarrmeta import DatasetFiles

RENAME_EXCHANGE = 2
PUBLISHING = "publishing"  # in the work folder: the build_id being moved to OUTPUT right now
REPLACED = "replaced.zarr"  # where the old dataset goes where there is no atomic exchange


@dataclass(frozen=True)
class BuildPaths:
    """Where one build of OUTPUT keeps its work. For a URL OUTPUT there is no rename: the
    dataset is written in place, its `complete` flag last, and the journal is one object per
    shard beside it; the lock stays on this machine."""

    url: str  # OUTPUT: an absolute local path or a URL
    storage_options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def remote(self) -> bool:
        return storage.is_url(self.url)

    @property
    def output(self) -> Path:
        return Path(self.url)

    @property
    def fs(self) -> Any:
        return storage.filesystem(self.url, self.storage_options) if self.remote else None

    @property
    def _beside(self) -> str:
        """OUTPUT's folder (or prefix) and a hidden name after OUTPUT's: where its work lives."""
        parent, name = storage.parent_and_name(self.url) if self.remote else (str(self.output.parent), self.output.name)
        return f"{parent}/.{name}.batchctl"

    @property
    def workdir_url(self) -> str:
        return self._beside

    @property
    def workdir(self) -> Path:
        return Path(self.workdir_url)

    @property
    def staging_url(self) -> str:
        return self.url if self.remote else str(self.workdir / "staging.zarr")

    @property
    def staging(self) -> Path:
        return Path(self.staging_url)

    @property
    def journal_url(self) -> str:
        return f"{self.workdir_url}/journal" if self.remote else str(self.workdir / "journal.jsonl")

    @property
    def journal(self) -> Path:
        return Path(self.journal_url)

    @property
    def state(self) -> Path:
        return self.workdir / "state.json"

    @property
    def record_url(self) -> str:
        """The record of the published dataset (which file each row came from): inside it."""
        return f"{self.url}/{RECORD}"

    @property
    def old_record_url(self) -> str:
        """Where an earlier batchctl kept the record: beside OUTPUT (read if none is inside, then removed)."""
        return f"{self._beside}.record"

    def spill_url(self, group: int) -> str:
        """`--engine dask`: where group `group`'s rows go when they are not one whole shard (group -1:
        an incremental build's carried rows)."""
        return f"{self.workdir_url}/spill/" + (f"{group:08d}.npz" if group >= 0 else "carry.npz")

    @property
    def local_dir(self) -> Path:
        """Where the lock lives: beside OUTPUT, or in the user's cache for a URL."""
        if not self.remote:
            return self.output.parent
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchctl"
        cache.mkdir(parents=True, exist_ok=True)
        return cache / hashlib.sha256(self.url.encode()).hexdigest()[:16]

    @property
    def lock(self) -> Path:
        if self.remote:
            return self.local_dir.with_suffix(".lock")
        return self.output.parent / f".{self.output.name}.batchctl.lock"

    def zarr_kwargs(self) -> dict[str, Any]:
        return storage.zarr_options(self.url, self.storage_options)

    @property
    def staging_files(self) -> DatasetFiles:
        """The staging dataset's documents and shards, written without zarr-python."""
        return DatasetFiles(self.staging_url, self.storage_options)


class Workdir(ABC):
    """Where one build of OUTPUT keeps its work, and how it publishes: the journal, the state, the
    work folder (or prefix) and the final step. `workdir(paths)` gives the local or the remote one."""

    def __init__(self, paths: BuildPaths) -> None:
        self.paths = paths
        self.warnings: list[str] = []  # said to the user: what went wrong but left a right dataset

    @abstractmethod
    def check(self) -> None:
        """Refuse, before anything is read or written, what a build must not trust or replace."""

    def check_replaceable(self) -> None:
        """Refuse, before any work, a dataset at OUTPUT this user could not replace at the end (a
        rerun that finds it up to date replaces nothing and is not refused). An object store's
        permissions are its own: a write it refuses fails in one line."""
        return

    @abstractmethod
    def start(self) -> None:
        """An empty work folder, whatever was there."""

    @abstractmethod
    def discard(self) -> None: ...

    @abstractmethod
    def write_state(self, state: journal.State) -> None: ...

    def read_state(self) -> journal.State | None:
        raw = self._state_bytes()
        if raw is None:
            return None
        try:
            return journal.parse_state(parse_json(raw))
        except ValueError as exc:  # Untrusted is one
            reason = str(exc) if isinstance(exc, Untrusted) else "it is not JSON"
            raise Untrusted(f"state.json: {reason}") from None

    @abstractmethod
    def _state_bytes(self) -> bytes | None: ...

    def read_journal(self, batch_size: int) -> list[journal.Line]:
        """The journal's lines, in order, up to a torn one: one per batch written, one per shard
        finished, one per Dask group finished (`Untrusted` for one not of batchctl's form)."""
        return journal.parse_lines(self._journal_values(), batch_size)

    @abstractmethod
    def _journal_values(self) -> list[Any]:
        """The journal's lines as JSON values, up to a torn one."""

    @abstractmethod
    def append_journal(self, lines: Sequence[journal.Line]) -> None:
        """Append lines durably (on an object store, whole shards only: `lines` end with the
        shard's `ShardDone`)."""

    @abstractmethod
    def append_group(self, line: journal.GroupLine) -> None:
        """Journal one finished Dask group."""

    @abstractmethod
    def rewrite_journal(self, lines: Sequence[journal.Line]) -> None:
        """Keep only `lines` (what a resumed build trusts)."""

    @abstractmethod
    def publish(self, files: Mapping[str, bytes], build_id: str, mark_complete: Callable[[], None]) -> None:
        """Put `files` (the record, the build info) in the staging dataset, mark it complete
        (`mark_complete`: the attributes of version `build_id`), put it in place, then drop the work.

        The work says what it is publishing (`PUBLISHING`, written durably first), so that a run
        killed at any point of this is either resumed (the dataset at OUTPUT is not yet
        `build_id`'s) or finished by the next run's `recover` (it is): once the dataset is in
        place, the work's staging dataset is the *previous* one and must never be resumed.
        SIGINT/SIGTERM wait until the dataset is in place and the state is gone, and from then on
        change nothing (`signals.published`): the command ends as a finished build, exit 0."""

    @abstractmethod
    def recover(self, published_id: str | None) -> str | None:
        """Finish or undo a publish a killed run left half done; `published_id` is the build_id
        of the complete dataset at OUTPUT (None: none there). Returns None when there was no
        publish to recover, a line when it finished one, "" when it undid one."""


def workdir(paths: BuildPaths) -> Workdir:
    return RemoteWorkdir(paths) if paths.remote else LocalWorkdir(paths)


class LocalWorkdir(Workdir):
    """A private folder beside OUTPUT; the dataset is published by one atomic rename (an atomic
    exchange when an older one is there)."""

    def check(self) -> None:
        self._check_private()
        self._check_replaceable()

    def _check_private(self) -> None:
        """Refuse a work folder that is not this user's, or that others could write into: its
        journal and state decide what a build trusts and deletes, and OUTPUT may sit in a shared folder."""
        workdir = self.paths.workdir
        try:
            st = os.lstat(workdir)
        except FileNotFoundError:
            return
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise UsageError(
                f"{workdir} is not a private folder of yours (a build creates it with mode 0700); "
                "batchctl will not trust or delete it: remove it yourself."
            )
        if st.st_mode & 0o077:  # ours, and nobody else could write into it (an older batchctl's): make it private
            os.chmod(workdir, 0o700)

    def _check_replaceable(self) -> None:
        """Refuse to replace anything at OUTPUT but an empty folder or a batchctl dataset."""
        output = self.paths.output
        if not output.exists():
            return
        if output.is_dir() and (not any(output.iterdir()) or (output / "zarr.json").is_file()):
            return
        raise UsageError(f"OUTPUT {output} exists and is not a batchctl dataset; refusing to replace it.")

    def check_replaceable(self) -> None:
        output = self.paths.output
        if output.is_dir() and not _replaceable(output):
            raise UsageError(
                f"OUTPUT {output} belongs to another user and cannot be replaced by you (its folder is shared "
                "or it is not writable); choose another OUTPUT."
            )

    def start(self) -> None:
        self.discard()
        self.paths.workdir.mkdir(mode=0o700)

    def discard(self) -> None:
        shutil.rmtree(self.paths.workdir, ignore_errors=True)

    def write_state(self, state: journal.State) -> None:
        tmp = self.paths.state.with_suffix(".tmp")
        tmp.write_text(json.dumps(state.to_json(), indent=2, sort_keys=True), encoding="utf-8")
        os.replace(tmp, self.paths.state)

    def _state_bytes(self) -> bytes | None:
        try:
            return read_regular(self.paths.state)
        except FileNotFoundError:
            return None
        except OSError as exc:  # a FIFO, a folder, a huge file: not batchctl's
            raise Untrusted(f"state.json: {exc.strerror}") from None

    def _journal_values(self) -> list[Any]:
        try:
            texts = read_regular(self.paths.journal, LOG_BYTES).splitlines()
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise Untrusted(f"the journal: {exc.strerror}") from None
        values: list[Any] = []
        for number, text in enumerate(texts, 1):
            try:
                values.append(parse_json(text))
            except ValueError:
                if number == len(texts):  # the line a kill cut short
                    break
                raise Untrusted(f"journal line {number} is not JSON") from None
        return values

    def append_journal(self, lines: Sequence[journal.Line]) -> None:
        if lines:
            self._append_lines(lines)

    def append_group(self, line: journal.GroupLine) -> None:
        self._append_lines([line])

    def rewrite_journal(self, lines: Sequence[journal.Line]) -> None:
        """Written aside and renamed: a full disk or a kill part way leaves the journal as it was,
        never cut short (the kept rows it names are what a resume, and an incremental build's
        state, count on)."""
        _write_durably(self.paths.journal, _jsonl(lines))
        _fsync_dir(self.paths.workdir)

    def _append_lines(self, lines: Sequence[journal.Line]) -> None:
        with open(self.paths.journal, "ab") as file:
            file.write(_jsonl(lines))
            file.flush()
            os.fsync(file.fileno())

    def publish(self, files: Mapping[str, bytes], build_id: str, mark_complete: Callable[[], None]) -> None:
        """Deleting the old dataset afterwards may be interrupted freely."""
        paths = self.paths
        for name, data in files.items():
            _write_durably(paths.staging / name, data)
        mark_complete()
        _write_durably(paths.workdir / PUBLISHING, build_id.encode())
        _fsync_dir(paths.workdir)
        with signals_ignored():
            if not paths.output.exists():
                os.rename(paths.staging, paths.output)
            elif not _exchange(paths.staging, paths.output):
                os.rename(paths.output, paths.workdir / REPLACED)
                os.rename(paths.staging, paths.output)
            _fsync_dir(paths.output.parent)
            self._finish_publish()
            published(True)  # before signals count again: from here a stop signal changes nothing
        self.discard()  # the old dataset: its deletion may be interrupted freely (a rerun ends it)

    def _finish_publish(self) -> None:
        """After the dataset is at OUTPUT: the state goes (nothing left to resume), and a record
        an older batchctl left beside OUTPUT; the caller then deletes the work folder (the old
        dataset)."""
        paths = self.paths
        paths.state.unlink(missing_ok=True)
        _fsync_dir(paths.workdir)
        old = Path(paths.old_record_url)
        try:
            if _ours(os.lstat(old)):
                old.unlink()
        except OSError:  # none there, or one we may not remove: it is never read again either way
            pass

    def recover(self, published_id: str | None) -> str | None:
        paths = self.paths
        marker = paths.workdir / PUBLISHING
        try:
            publishing = read_regular(marker).decode("ascii").strip()
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            publishing = ""
        finished = bool(publishing) and publishing == published_id
        with signals_ignored():
            if finished:
                self._finish_publish()
            else:
                self._undo_publish()
        if not finished:
            return ""
        self.discard()
        return "finished publishing the last build, which was stopped just after its dataset was in place"

    def _undo_publish(self) -> None:
        """A publish stopped before its exchange: the staging dataset is still this build's, to
        be resumed; the old dataset goes back if it was moved aside (no renameat2)."""
        paths = self.paths
        replaced = paths.workdir / REPLACED
        if not paths.output.exists() and replaced.is_dir():  # stopped between the two renames
            os.rename(replaced, paths.output)
            _fsync_dir(paths.output.parent)
        (paths.workdir / PUBLISHING).unlink()
        _fsync_dir(paths.workdir)


class RemoteWorkdir(Workdir):
    """Objects under `.NAME.batchctl/` beside a URL OUTPUT. An object store has no rename and no
    append: the dataset is written in place, its `complete` flag last; the journal is one object
    per shard (or per Dask group), each appearing whole or not at all."""

    def __init__(self, paths: BuildPaths) -> None:
        super().__init__(paths)
        self.fs = paths.fs

    def check(self) -> None:
        """Refuse to replace anything at OUTPUT but an empty prefix or a batchctl dataset."""
        where = storage.fs_path(self.paths.url)
        if self.fs.exists(where) and self.fs.ls(where) and not self.fs.exists(f"{where}/zarr.json"):
            raise UsageError(f"OUTPUT {self.paths.url} exists and is not a batchctl dataset; refusing to replace it.")

    def start(self) -> None:
        self.discard()

    def discard(self) -> None:
        where = storage.fs_path(self.paths.workdir_url)
        if self.fs.exists(where):
            self.fs.rm(where, recursive=True)

    def _state_key(self) -> str:
        return self._work_key("state.json")

    def write_state(self, state: journal.State) -> None:
        self.fs.pipe_file(self._state_key(), json.dumps(state.to_json()).encode())

    def _state_bytes(self) -> bytes | None:
        try:
            return bytes(self.fs.cat_file(self._state_key()))
        except FileNotFoundError:
            return None

    def _journal_values(self) -> list[Any]:
        values: list[Any] = []
        for name in self._journal_objects():
            try:
                found = parse_json(self.fs.cat_file(name))
            except FileNotFoundError:
                continue
            except ValueError:
                raise Untrusted(f"journal object {name} is not JSON") from None
            if not isinstance(found, list):
                raise Untrusted(f"journal object {name} is not a list of lines")
            values += found
        return values

    def _journal_objects(self) -> list[str]:
        where = storage.fs_path(self.paths.journal_url)
        self.fs.invalidate_cache(where)  # other processes (the collator, Dask workers) wrote objects since
        return sorted(self.fs.ls(where, detail=False)) if self.fs.exists(where) else []

    def _shard_key(self, shard: int) -> str:
        return storage.fs_path(f"{self.paths.journal_url}/{shard:08d}.json")

    def _group_key(self, group: int) -> str:
        """Named to sort after the shards' objects (the carry's group is -1)."""
        return storage.fs_path(f"{self.paths.journal_url}/g{group + 1:08d}.json")

    def append_journal(self, lines: Sequence[journal.Line]) -> None:
        if lines:
            last = lines[-1]
            assert isinstance(last, journal.ShardDone), "an object store journals whole shards"
            self.fs.pipe_file(self._shard_key(last.shard), _json_lines(lines))

    def append_group(self, line: journal.GroupLine) -> None:
        self.fs.pipe_file(self._group_key(line.group), _json_lines([line]))

    def rewrite_journal(self, lines: Sequence[journal.Line]) -> None:
        keep = {self._shard_key(line.shard) for line in lines if isinstance(line, journal.ShardDone)}
        keep |= {self._group_key(line.group) for line in lines if isinstance(line, journal.GroupLine)}
        stale = [name for name in self._journal_objects() if name not in keep]
        if stale:
            self.fs.rm(stale)

    def publish(self, files: Mapping[str, bytes], build_id: str, mark_complete: Callable[[], None]) -> None:
        """The dataset was written in place: its record and build info go in, then it is marked
        complete (its last write), then the work objects go."""
        with signals_ignored():
            for name, data in files.items():
                self.fs.pipe_file(storage.fs_path(f"{self.paths.url}/{name}"), data)
            self.fs.pipe_file(self._work_key(PUBLISHING), build_id.encode())
            mark_complete()
            self._finish_publish()
            published(True)  # before signals count again: from here a stop signal changes nothing
        self.discard()

    def _finish_publish(self) -> None:
        """The state goes, and a record an older batchctl copied beside OUTPUT."""
        for key in (self._state_key(), storage.fs_path(self.paths.old_record_url)):
            if self.fs.exists(key):
                self.fs.rm(key)

    def recover(self, published_id: str | None) -> str | None:
        marker = self._work_key(PUBLISHING)
        try:
            publishing = self.fs.cat_file(marker).decode("ascii", "replace").strip()
        except FileNotFoundError:
            return None
        finished = bool(publishing) and publishing == published_id
        with signals_ignored():
            if finished:
                self._finish_publish()
            elif self.fs.exists(marker):
                self.fs.rm(marker)
        if not finished:
            return ""
        self.discard()
        return "finished publishing the last build, which was stopped just after its dataset was complete"

    def _work_key(self, name: str) -> str:
        return storage.fs_path(f"{self.paths.workdir_url}/{name}")


def _jsonl(lines: Sequence[journal.Line]) -> bytes:
    """The local journal's lines: one JSON object a line."""
    return "".join(json.dumps(journal.to_json(line)) + "\n" for line in lines).encode()


def _json_lines(lines: Sequence[journal.Line]) -> bytes:
    """One journal object: a JSON list of lines."""
    return json.dumps([journal.to_json(line) for line in lines]).encode()


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with renameat2(RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    result = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), RENAME_EXCHANGE)
    if result == 0:
        return True
    if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), str(b))


def _ours(st: os.stat_result) -> bool:
    """A regular file of this user's."""
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()


def _replaceable(output: Path) -> bool:
    """This user may move the folder `output` away: it is writable (its `..` entry changes), and
    in a sticky folder (such as /tmp) it or the folder is this user's."""
    parent = os.stat(output.parent)
    owned = os.stat(output).st_uid == os.geteuid() or parent.st_uid == os.geteuid() or _has_capability(CAP_FOWNER)
    return os.access(output, os.W_OK) and (owned or not parent.st_mode & stat.S_ISVTX)


CAP_FOWNER = 3  # lets root (and whoever holds it) move other users' files out of a sticky folder


def _has_capability(bit: int) -> bool:
    try:
        status = Path("/proc/self/status").read_text(encoding="ascii")
    except OSError:
        return os.geteuid() == 0
    effective = next((line.split()[1] for line in status.splitlines() if line.startswith("CapEff:")), "0")
    return bool(int(effective, 16) >> bit & 1)


def _write_durably(path: Path, data: bytes) -> None:
    """`path` holds `data` whole, on disk, or is left as it was (written aside, then renamed)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
