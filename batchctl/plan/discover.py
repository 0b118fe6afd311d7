"""Discover: walk SOURCE into work items, class labels and an input fingerprint."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from stat import S_ISREG
from typing import Any

import numpy as np

from batchctl.errors import UsageError
from batchctl.plan import tables
from batchctl.preprocess.base import read_path
from batchctl.records import WorkItem
from batchctl.store import storage

IGNORED_LISTED = 1000  # ignored files named (all are counted)


@dataclass
class Discovery:
    items: list[WorkItem]
    classes: list[str] | None
    ignored: int = 0
    unreadable: list[tuple[str, str]] = field(default_factory=list)
    ignored_paths: list[str] = field(default_factory=list)  # the first IGNORED_LISTED, in walk order
    row_hashes: dict[str, str] = field(default_factory=dict)  # relpath -> its metadata row's hash
    texts: dict[str, int] = field(default_factory=dict)  # the tables' text fields and their widths
    notes: list[str] = field(default_factory=list)  # what the user is told of the metadata tables
    content: tuple[str, str] | None = None  # (table, column): a Parquet SOURCE holding the rows' files

    def fingerprint(
        self, options: object, leave_out: Collection[str] = (), digests: Mapping[str, str] | None = None
    ) -> str:
        """Changes when any input path, size or mtime changes (with `digests`, content hashes:
        --checksum), or its metadata row, or what cannot be read, or the options. A dataset built
        without the files `leave_out` gets a fingerprint the next discovery (with them) will not
        match, so the next run tries them again."""
        digest = hashlib.sha256(repr(options).encode())
        for item in sorted(self.items, key=lambda it: it.relpath):
            if item.relpath in leave_out:
                continue
            stamp = digests.get(item.relpath, "") if digests else item.mtime_ns
            row = self.row_hashes.get(item.relpath, "")
            digest.update(f"{item.relpath}\0{item.size}\0{stamp}\0{row}\n".encode())
        for where, why in sorted(self.unreadable):  # a table's bad line mended is a change too
            digest.update(f"{where}\0{why}\n".encode())
        return digest.hexdigest()


def watch_reads(discovery: Discovery, source: str, patterns: tuple[str, ...]) -> None:
    """Fold the stamps (size and mtime, or absence) of the files a plugin declares it reads
    (`@reads`) into each input's row hash, so an edited sidecar rebuilds its input alone and an
    edited shared file every input. The sidecars are no inputs themselves: counted as ignored."""
    if not patterns:
        return
    if storage.is_url(source) or discovery.content is not None:
        where = "a URL SOURCE" if storage.is_url(source) else "a Parquet holding the files"
        raise UsageError(f"the plugin declares files it reads (@reads), which {where} does not have beside its inputs")
    root = Path(tables.files_root(source))
    stamps: dict[str, str] = {}

    def stamp(relpath: str) -> str:
        if relpath not in stamps:
            try:
                found = os.stat(root / relpath)
                stamps[relpath] = f"{found.st_size}:{found.st_mtime_ns}"
            except OSError:
                stamps[relpath] = "none"
        return stamps[relpath]

    read_by = {item.relpath: [read_path(p, item.relpath) for p in patterns] for item in discovery.items}
    sidecars = {relpath for reads in read_by.values() for relpath in reads}
    kept = [item for item in discovery.items if item.relpath not in sidecars]
    for item in kept:
        seen = "\0".join(f"{relpath}={stamp(relpath)}" for relpath in read_by[item.relpath])
        row = discovery.row_hashes.get(item.relpath, "")
        discovery.row_hashes[item.relpath] = hashlib.sha256(f"{row}\0{seen}".encode()).hexdigest()
    left_out = [item.relpath for item in discovery.items if item.relpath in sidecars]
    discovery.items = kept
    discovery.ignored += len(left_out)
    room = IGNORED_LISTED - len(discovery.ignored_paths)
    discovery.ignored_paths.extend(left_out[: max(room, 0)])


def hash_files(
    source: str, items: list[WorkItem], storage_options: Mapping[str, Any] | None, threads: int
) -> dict[str, str]:
    """Each file's SHA-256 (for --checksum), read by a few threads at once (hashlib releases the
    GIL); an object's ETag for a URL SOURCE. A file that cannot be read gets no hash (its worker
    will report it)."""
    if storage.is_url(source):
        fs, root = storage.locate(source, storage_options)

        def one(item: WorkItem) -> str:
            return str(fs.info(f"{root}/{item.relpath}").get("ETag", "")).strip('"')

    else:

        def one(item: WorkItem) -> str:
            with open(Path(source) / item.relpath, "rb") as file:
                return hashlib.file_digest(file, "sha256").hexdigest()

    def safe(item: WorkItem) -> tuple[str, str | None]:
        try:
            return item.relpath, one(item)
        except Exception:  # noqa: BLE001 - unreadable: reported by the worker that meets it
            return item.relpath, None

    with ThreadPoolExecutor(max(2, threads)) as pool:
        return {relpath: value for relpath, value in pool.map(safe, items) if value}


class FolderError(OSError):
    """A folder that cannot be walked (unreadable, or a symlink loop): reported whatever its name."""


def walk_files(root: Path, skip: str | None = None) -> Iterable[tuple[str, os.stat_result | OSError]]:
    """Non-hidden files under `root`, recursively, in sorted order, following directory symlinks
    once each (a symlink loop is reported, never followed twice); `skip` (a relative path) and
    everything under it are left out."""
    seen: set[tuple[int, int]] = set()

    def visit(directory: Path, prefix: str) -> Iterable[tuple[str, os.stat_result | OSError]]:
        name = prefix.rstrip("/") or "."
        try:
            st = directory.stat()
            if (st.st_dev, st.st_ino) in seen:
                raise FolderError(f"symlink loop: {name} leads back to a folder already walked")
            seen.add((st.st_dev, st.st_ino))
            entries = sorted(os.scandir(directory), key=lambda e: e.name)
        except FolderError as exc:
            yield name, exc
            return
        except OSError as exc:
            yield name, FolderError(exc.errno, exc.strerror)
            return
        for entry in entries:
            if entry.name.startswith("."):
                continue
            rel = prefix + entry.name
            if rel == skip:
                continue
            try:
                is_dir = entry.is_dir()
            except OSError:
                is_dir = False
            if is_dir:
                yield from visit(Path(entry.path), rel + "/")
                continue
            try:
                yield rel, entry.stat()
            except OSError as exc:
                yield rel, exc

    yield from visit(root, "")


def check_source(source: str) -> None:
    """A local SOURCE must be a folder or a table: a usage error, found before anything is done
    (or locked)."""
    if not storage.is_url(source) and not Path(source).is_dir() and not tables.is_table_source(source):
        raise UsageError(f"SOURCE {source} is not a folder (nor a table: .csv, .tsv, .jsonl, .parquet).")


def discover(
    source: str,
    accepts: Callable[[str], bool],
    seed: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    output: str | None = None,
    label: str | None = None,
    path_column: str = tables.FILE_NAME,
    text_column: str | None = None,
) -> Discovery:
    """Files `accepts` takes become work items; the rest are counted as ignored, and so are
    FIFOs, sockets and devices (reading one could block for ever).

    With class sub-folders the first path component names the class (sorted, numbered from 0)
    and files lying directly in SOURCE, having no class, are ignored; a flat folder has no labels.
    SOURCE may be a URL (s3://bucket/raw/): its objects are listed through fsspec. An `output`
    inside SOURCE is never an input (its staging folder and lock are hidden files anyway).
    A file name that is not UTF-8 is reported unreadable: the dataset stores names as UTF-8.
    Metadata tables (`batchctl.plan.tables`) are no inputs: once there is one, the files they
    name are the inputs, with their rows' values, and `label` names the column of their classes.
    """
    if text_column is not None and not (tables.is_url_table(source) or tables.is_table_source(source)):
        raise UsageError(
            f"--option column={text_column} names a column of documents in a table SOURCE; {source} is none"
        )
    skip = _inside(output, source)
    if tables.is_url_table(source):
        return _discover_url_table(source, accepts, seed, storage_options, label, path_column, text_column)
    if storage.is_url(source):
        if label is not None:
            raise UsageError("--label reads metadata tables in a local SOURCE folder; a URL SOURCE has none yet")
        return _discover_url(source, accepts, seed, storage_options, skip)
    check_source(source)
    if tables.is_table_source(source):
        return _discover_table(Path(source), accepts, seed, label, path_column, text_column)
    found: list[tuple[str, int, int]] = []
    ignored: list[str] = []
    unreadable: list[tuple[str, str]] = []
    table_paths: list[str] = []
    for rel, stat in walk_files(Path(source), skip):
        if tables.is_table(rel) and not isinstance(stat, OSError) and S_ISREG(stat.st_mode):
            table_paths.append(rel)
        elif not (rel.isascii() or _utf8(rel)):
            unreadable.append((_printable(rel), "the file name is not valid UTF-8; rename it to build it"))
        elif isinstance(stat, FolderError):
            unreadable.append((rel, stat.strerror or str(stat)))
        elif not accepts(rel):
            ignored.append(rel)
        elif isinstance(stat, OSError):
            unreadable.append((rel, stat.strerror or str(stat)))
        elif not S_ISREG(stat.st_mode):
            ignored.append(rel)
        else:
            found.append((rel, stat.st_size, stat.st_mtime_ns))
    if not table_paths:
        if label is not None:
            raise UsageError(f"--label {label}: SOURCE {source} holds no {' or '.join(tables.TABLE_NAMES)}")
        return _labelled(found, ignored, unreadable, seed)
    return _tabled(Path(source), table_paths, found, ignored, unreadable, seed, label)


def _discover_table(
    table: Path,
    accepts: Callable[[str], bool],
    seed: int | None,
    label: str | None,
    path_column: str,
    text_column: str | None = None,
) -> Discovery:
    """SOURCE is a table: its rows name the files (relative to its folder), one sample source
    each, with their values; a named file the preprocessor does not take is ignored."""
    folder = f"{table.parent}/"  # (a str joined to each path: a Path per row cost a tenth of the reading)

    def stamp(relpath: str) -> tuple[int, int] | None:
        try:
            found = os.stat(folder + relpath)
        except OSError:
            return None
        return (found.st_size, found.st_mtime_ns) if S_ISREG(found.st_mode) else None

    return _table_rows(table, table.name, stamp, accepts, seed, label, path_column, text_column)


def _discover_url_table(
    source: str,
    accepts: Callable[[str], bool],
    seed: int | None,
    storage_options: Mapping[str, Any] | None,
    label: str | None,
    path_column: str,
    text_column: str | None = None,
) -> Discovery:
    """A table at a URL (`s3://bucket/train.csv`): fetched to this machine and read there; the
    objects its rows name, relative to the table's prefix, listed once for their stamps (an
    http(s) server lists nothing: its rows' files are fetched, or skipped, by the workers)."""
    prefix, _, name = source.rpartition("/")
    http = source.startswith(("http://", "https://"))
    listing = {} if http else _listed(prefix, storage_options)
    with tempfile.TemporaryDirectory(prefix="batchctl-table-") as folder:
        copy = Path(folder) / name
        try:
            storage.fetch_url(source, str(copy), storage_options)
        except OSError as exc:
            raise UsageError(f"SOURCE {source} cannot be fetched: {exc.strerror or exc}") from None
        stamp = (lambda rel: (0, 0)) if http else listing.get
        discovery = _table_rows(copy, name, stamp, accepts, seed, label, path_column, text_column)
    if discovery.content is not None:  # (their rows are written out again from the table, read where it lies)
        held = "documents" if text_column else "files"
        raise UsageError(
            f"SOURCE {source} holds its rows' {held}, which a build reads from a local copy: download it first"
        )
    return discovery


def _listed(prefix: str, storage_options: Mapping[str, Any] | None) -> dict[str, tuple[int, int]]:
    """The objects under a URL prefix, by path relative to it: (size, LastModified in ns)."""
    fs, root = storage.locate(prefix, storage_options)
    try:
        listing = fs.find(root, detail=True)
    except Exception as exc:  # noqa: BLE001 - the store's client raises many kinds
        raise UsageError(f"SOURCE {prefix} cannot be listed: {exc}") from None
    return {name[len(root) :].lstrip("/"): _object_stamp(entry) for name, entry in listing.items()}


def _object_stamp(entry: Mapping[str, Any]) -> tuple[int, int]:
    modified = entry.get("LastModified") or entry.get("mtime") or 0
    stamp = int(modified.timestamp() * 1e9) if hasattr(modified, "timestamp") else int(float(modified) * 1e9)
    return int(entry.get("size") or 0), stamp


def _table_rows(
    table: Path,
    name: str,
    stamp: Callable[[str], tuple[int, int] | None],
    accepts: Callable[[str], bool],
    seed: int | None,
    label: str | None,
    path_column: str,
    text_column: str | None = None,
) -> Discovery:
    """The inputs a table SOURCE names, each file's `stamp` (size, mtime) or None: not there."""
    stamps: dict[str, tuple[int, int]] = {}

    def present(relpath: str) -> bool:
        if storage.is_url(relpath):  # fetched by the worker (a failed fetch is that row's skip)
            return True
        found = stamp(relpath)
        if found is not None:
            stamps[relpath] = found
        return found is not None

    read = tables.read_tables(table.parent, [name], present, label, path_column, urls=True, text_column=text_column)
    found, ignored = [], []
    for relpath in read.values:
        size, mtime_ns = stamps.get(relpath, (0, 0))  # (none for a URL: its stamp is its row's, (0, 0) here)
        content = read.contents.get(relpath)  # (a file the table holds: its stamp is its row's hash)
        if content is not None and (content.name is None or accepts(content.name)):
            found.append((relpath, content.size, 0))
        elif content is None and accepts(relpath):
            found.append((relpath, size, mtime_ns))
        else:
            ignored.append(relpath)
    discovery = _named_by(read, found, ignored, list(read.bad_rows), seed, label, False, name)
    if read.content_column is not None:
        discovery.content = (name, read.content_column)
    return discovery


def _tabled(
    root: Path,
    table_paths: list[str],
    found: list[tuple[str, int, int]],
    ignored: list[str],
    unreadable: list[tuple[str, str]],
    seed: int | None,
    label: str | None,
) -> Discovery:
    """The files the tables name, with their values; the files they do not name are ignored
    (counted and listed, as files the preprocessor does not take). Labels: `label`'s column, or
    the class folders as without tables."""
    names = {rel for rel, _, _ in found}
    read = tables.read_tables(root, table_paths, names.__contains__, label)
    named = [entry for entry in found if entry[0] in read.values]
    ignored.extend(rel for rel, _, _ in found if rel not in read.values)
    unreadable.extend(read.bad_rows)
    return _named_by(read, named, ignored, unreadable, seed, label, True, f"{len(table_paths)} metadata table(s)")


def _named_by(
    read: tables.Tables,
    found: list[tuple[str, int, int]],
    ignored: list[str],
    unreadable: list[tuple[str, str]],
    seed: int | None,
    label: str | None,
    folders: bool,
    tables_named: str,
) -> Discovery:
    """The discovery of the files `found` that tables name, with their rows' values: labelled by
    `label`'s column, else (`folders`) by the class folders, else not at all."""
    if label is None and folders:
        discovery = _labelled(found, ignored, unreadable, seed)
    else:
        items = [
            WorkItem(rel, -1 if label is None else read.label_of(rel), size, mtime_ns) for rel, size, mtime_ns in found
        ]
        discovery = Discovery(shuffled(items, seed), read.classes, len(ignored), unreadable, ignored[:IGNORED_LISTED])
    for item in discovery.items:
        item.values = read.values[item.relpath]
    discovery.row_hashes, discovery.texts = read.row_hashes, read.texts
    discovery.notes = [*read.left_out, f"{len(found)} files named by {tables_named}"]
    return discovery


def _inside(output: str | None, source: str) -> str | None:
    """`output`'s path relative to `source`, when it lies inside it."""
    if output is None or storage.is_url(output) != storage.is_url(source):
        return None
    base = source.rstrip("/") + "/"
    return output[len(base) :].rstrip("/") if output.startswith(base) else None


def _utf8(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # undecodable bytes, kept by Python as surrogates
        return False
    return True


def _printable(name: str) -> str:
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def _discover_url(
    source: str,
    accepts: Callable[[str], bool],
    seed: int | None,
    storage_options: Mapping[str, Any] | None,
    skip: str | None,
) -> Discovery:
    """The objects under a URL; an object's stamp is its size and LastModified time."""
    listing = _listed(source, storage_options)
    if not listing:
        raise UsageError(f"SOURCE {source}: no objects there.")
    found: list[tuple[str, int, int]] = []
    ignored: list[str] = []
    for rel, (size, mtime_ns) in sorted(listing.items()):
        if any(part.startswith(".") for part in rel.split("/")) or (skip and (rel + "/").startswith(skip + "/")):
            continue
        if not accepts(rel):
            ignored.append(rel)
            continue
        found.append((rel, size, mtime_ns))
    return _labelled(found, ignored, [], seed)


def _labelled(
    found: list[tuple[str, int, int]], ignored: list[str], unreadable: list[tuple[str, str]], seed: int | None
) -> Discovery:
    nested = sorted({rel.split("/", 1)[0] for rel, _, _ in found if "/" in rel})
    classes = nested or None
    class_ids = {name: i for i, name in enumerate(nested)}
    items = []
    for rel, size, mtime_ns in found:
        if classes is None:
            items.append(WorkItem(rel, -1, size, mtime_ns))
        elif "/" in rel:
            items.append(WorkItem(rel, class_ids[rel.split("/", 1)[0]], size, mtime_ns))
        else:
            ignored.append(rel)  # beside the class folders: no class
    return Discovery(shuffled(items, seed), classes, len(ignored), unreadable, ignored[:IGNORED_LISTED])


def shuffled(items: list[WorkItem], seed: int | None) -> list[WorkItem]:
    """The items in the seed's order (as found, without one: `--sorted`)."""
    if seed is None:
        return items
    # (numpy's permutation: random.shuffle took ~0.7 us a file, a sixth of the walk)
    return [items[i] for i in np.random.default_rng(seed).permutation(len(items)).tolist()]
