"""Where datasets live: a local folder, or a URL of an fsspec filesystem (s3://, gs://, az://...).

Local paths keep their own fast paths (fsync, rename, pread); a URL goes through fsspec, whose
packages (s3fs, gcsfs, adlfs) are optional extras. Credentials and endpoints come from the
packages' usual environment (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ...) or `storage_options`.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import inspect
import json
import os
import pickle
import shutil
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from batchctl.errors import BatchctlError, UsageError
from batchctl.records import describe_error


def is_url(location: str | os.PathLike[str]) -> bool:
    text = os.fspath(location)
    return "://" in text and not text.startswith("file://")


def normalise(location: str | os.PathLike[str]) -> str:
    """A URL without a trailing slash, or an absolute local path."""
    text = os.fspath(location)
    return text.rstrip("/") if is_url(text) else os.path.abspath(text)


TABLE_SUFFIXES = (".csv", ".tsv", ".jsonl", ".parquet")  # a table given as SOURCE itself


def default_output(source: str | os.PathLike[str]) -> str:
    """SOURCE's own name plus `.zarr`, beside it: `data/` -> `data.zarr`, `s3://b/raw/` -> `s3://b/raw.zarr`,
    `train.csv` -> `train.zarr`."""
    where = normalise(source)
    if is_url(where):
        scheme, _, path = where.partition("://")
        parent, _, name = path.rpartition("/")
        if not parent or not name:
            raise UsageError(f"SOURCE {source} is a bucket's root: name OUTPUT with -o.")
        if name.lower().endswith(TABLE_SUFFIXES):  # s3://b/train.csv -> s3://b/train.zarr
            name = name.rsplit(".", 1)[0]
        return f"{scheme}://{parent}/{name}.zarr"
    if where == os.path.dirname(where):
        raise UsageError(f"SOURCE {source} is the root folder: name OUTPUT with -o.")
    if os.path.isfile(where):  # a table: train.csv -> train.zarr
        where = os.path.splitext(where)[0]
    return where + ".zarr"


IO_TIMEOUT_S = 300.0  # one store call (a 128 MiB shard's PUT included) gives up after this long
S3_TIMEOUTS = {"connect_timeout": 10, "read_timeout": 60}  # botocore's defaults are 60 and 60, retried


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> Any:
    """The fsspec filesystem of `url` (one instance per URL scheme and options). Each of its
    calls gives up after `io_timeout` seconds (a storage option of batchctl's own, default
    IO_TIMEOUT_S) with a `StoreError` naming the store, the call and the path."""
    options = json.dumps(dict(storage_options or {}), sort_keys=True)
    return _filesystem(url.split("://", 1)[0], options, os.getpid())  # a forked child's own: they are not fork-safe


def fsspec_options(protocol: str, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The options fsspec gets for a store: batchctl's `io_timeout` left out, and S3's connect
    and read timeouts bounded unless given (a frozen server otherwise holds a call for minutes)."""
    kwargs = {key: value for key, value in (storage_options or {}).items() if key != "io_timeout"}
    if protocol in ("s3", "s3a"):
        kwargs["config_kwargs"] = {**S3_TIMEOUTS, **dict(kwargs.get("config_kwargs") or {})}
    return kwargs


class StoreError(BatchctlError, OSError):
    """A call to an object store failed or timed out (`strerror` names the store, the call and
    the path): an OSError, as the store's own errors are, and a BatchctlError of one line."""

    def __str__(self) -> str:
        return self.strerror if isinstance(self.strerror, str) else super().__str__()


class TimedFilesystem:
    """An fsspec filesystem whose blocking calls end after `timeout` seconds (async filesystems:
    fsspec's own `timeout`, which cancels the request) and whose failures are one `StoreError`
    line; a missing object is still a `FileNotFoundError`, which callers test for."""

    def __init__(self, fs: Any, protocol: str, timeout: float) -> None:
        self._fs, self._protocol, self._timeout = fs, protocol, timeout

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # ours are set in __init__ (not yet while unpickling); the store's stay its own
            raise AttributeError(name)
        attr = getattr(self._fs, name)
        if not callable(attr):
            return attr
        timed = inspect.iscoroutinefunction(getattr(self._fs, f"_{name}", None))

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **({"timeout": self._timeout, **kwargs} if timed else kwargs))
            except (FileNotFoundError, StoreError):
                raise
            except Exception as exc:  # noqa: BLE001 - each store's client raises its own kinds
                path = args[0] if args and isinstance(args[0], str) else ""
                timed_out = type(exc).__name__ == "FSTimeoutError"
                what = f"no answer in {kwargs.get('timeout', self._timeout):g} s" if timed_out else describe_error(exc)
                raise StoreError(errno.EIO, f"{self._protocol}://{path} ({name}): {what}") from None

        return call


@functools.cache
def _filesystem(protocol: str, options: str, pid: int) -> Any:
    import fsspec

    given = json.loads(options)
    kwargs = fsspec_options(protocol, given)
    # No listing cache: other processes (the collator, Dask workers, a rebuild) add and remove
    # objects, and a cached listing would hide them (a reader would call a new shard missing).
    kwargs.setdefault("use_listings_cache", False)
    try:
        return TimedFilesystem(
            fsspec.filesystem(protocol, **kwargs), protocol, float(given.get("io_timeout", IO_TIMEOUT_S))
        )
    except ImportError as exc:
        extra = {"s3": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure"}.get(protocol, protocol)
        raise UsageError(
            f"{protocol}:// needs an fsspec package that is not installed ({exc}); "
            f"install it with: pip install 'batchctl[{extra}]'"
        ) from None
    except ValueError as exc:
        raise UsageError(f"{protocol}:// is not a filesystem fsspec knows: {exc}") from None


def local_filesystem() -> Any:
    import fsspec

    return fsspec.filesystem("file")


def locate(location: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """The fsspec filesystem holding `location` and the path inside it, local or remote alike."""
    if is_url(location):
        return filesystem(location, storage_options), fs_path(location)
    return local_filesystem(), location


def fs_path(url: str) -> str:
    """The path inside its filesystem: the URL without its scheme."""
    return url.split("://", 1)[1]


def parent_and_name(url: str) -> tuple[str, str]:
    parent, _, name = url.rpartition("/")
    return parent, name


def zarr_options(location: str, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """Keyword arguments for zarr.open_group: storage options only for URLs (zarr refuses them
    for local paths)."""
    if not is_url(location):
        return {}
    return {"storage_options": fsspec_options(str(location).split("://", 1)[0], storage_options)}


def tree_bytes(location: str, storage_options: Mapping[str, Any] | None = None) -> int:
    """Bytes stored under a dataset, local or remote."""
    if is_url(location):
        fs = filesystem(location, storage_options)
        return int(sum(info["size"] for info in fs.find(fs_path(location), detail=True).values()))
    return sum(entry.stat().st_size for entry in _walk(location))


def _walk(root: str) -> list[os.DirEntry[str]]:
    found: list[os.DirEntry[str]] = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return found
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            found.extend(_walk(entry.path))
        elif entry.is_file(follow_symlinks=False):
            found.append(entry)
    return found


def parse_storage_options(pairs: list[str]) -> dict[str, Any]:
    """`key=value` pairs; values parsed as JSON where they are (numbers, true/false, objects)."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"Expected --storage-option KEY=VALUE, got {pair!r} instead.")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    # a nested option may be given dotted: client_kwargs.endpoint_url=...
    nested: dict[str, Any] = {}
    for key, value in options.items():
        target = nested
        *parents, last = key.split(".")
        for part in parents:
            target = target.setdefault(part, {})
        target[last] = value
    return nested


FETCH_TRIES = 3  # a URL's fetch is tried this often over passing failures (connection, 5xx), 0.5 s apart, then 1 s
URL_SCHEMES = ("http", "https", "s3", "gs", "gcs", "az", "abfs")  # what a table's row may name


def fetch_url(url: str, path: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """Copy the URL's bytes into `path`: http(s) by the standard library, an object store by
    fsspec (`storage_options`). Raises OSError naming the URL and why, after FETCH_TRIES tries
    for failures that pass; at once for one that will not (HTTP 4xx, a missing object)."""
    for attempt in range(FETCH_TRIES):
        try:
            if url.startswith(("http://", "https://")):
                with urllib.request.urlopen(url, timeout=30) as response, open(path, "wb") as out:
                    shutil.copyfileobj(response, out, 2**20)
            else:
                filesystem(url, storage_options).get_file(fs_path(url), path)
            return
        except urllib.error.HTTPError as exc:
            if exc.code < 500 or attempt == FETCH_TRIES - 1:
                raise OSError(errno.EIO, f"cannot fetch {url}: HTTP {exc.code} {exc.reason}") from None
        except FileNotFoundError:
            raise OSError(errno.ENOENT, f"cannot fetch {url}: no such object") from None
        except (OSError, urllib.error.URLError) as exc:
            if attempt == FETCH_TRIES - 1:
                reason = getattr(exc, "reason", None) or exc.strerror or exc
                raise OSError(errno.EIO, f"cannot fetch {url}: {reason} ({FETCH_TRIES} tries)") from None
        time.sleep(0.5 * (attempt + 1))


DATASET_FILE = "dataset.pickle"  # a map-style dataset given to build(), pickled for the workers


def input_file(folder: Path, key: str) -> Path:
    """Where the pickle of the Python input named `key` lies (any text names a file this way)."""
    return folder / hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class SourceRoot:
    """SOURCE as workers see it: a folder, or a URL whose objects are fetched one at a time; a
    Parquet table SOURCE that holds its rows' files has them written out, named by line, to `rows`;
    Python inputs (`inputs`) are pickled in `rows`, by key or as one dataset."""

    root: str
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    rows: str = ""  # where the files of the rows "TABLE:LINE" of `table` were written
    table: str = ""
    inputs: str = ""  # "items": an iterable's items pickled one by one; "dataset": a map-style dataset

    def input_of(self, key: str) -> Any:
        """The Python input named `key`, as the preprocessing function takes it."""
        if self.inputs == "dataset":
            return _dataset(self.rows)[int(key)]
        return pickle.loads(input_file(Path(self.rows), key).read_bytes())

    @functools.cached_property
    def folder(self) -> Path | None:
        """The local folder, or None for a URL."""
        return None if is_url(self.root) else Path(self.root)

    def local_file(self, relpath: str) -> contextlib.AbstractContextManager[Path]:
        """A local path holding `relpath`: the file itself, or a temporary copy of the object
        or of the URL a table names (preprocessors and plugins take paths), removed once the
        file is preprocessed."""
        if "://" in relpath:  # a table's row names a URL (a walked path never holds "//")
            return self._fetched_url(relpath)
        if self.rows and relpath.startswith(f"{self.table}:") and relpath[len(self.table) + 1 :].isdigit():
            return contextlib.nullcontext(Path(self.rows) / relpath[len(self.table) + 1 :])
        if self.folder is not None:  # checked once per source, not per file (tiny files count)
            return contextlib.nullcontext(self.folder / relpath)
        if self.root.startswith(("http://", "https://")):  # a table on a web server names files beside it
            return self._fetched_url(f"{self.root}/{relpath}")
        return self._fetched(relpath)

    @contextlib.contextmanager
    def _fetched_url(self, url: str) -> Iterator[Path]:
        suffix = PurePosixPath(urllib.parse.urlsplit(url).path).suffix
        with tempfile.NamedTemporaryFile(prefix="batchctl-", suffix=suffix) as copy:
            fetch_url(url, copy.name, self.storage_options)
            yield Path(copy.name)

    @contextlib.contextmanager
    def _fetched(self, relpath: str) -> Iterator[Path]:
        fs = filesystem(self.root, self.storage_options)
        with tempfile.NamedTemporaryFile(prefix="batchctl-", suffix=PurePosixPath(relpath).suffix) as copy:
            fs.get_file(f"{fs_path(self.root)}/{relpath}", copy.name)
            yield Path(copy.name)


@functools.cache
def _dataset(folder: str) -> Any:
    """A map-style dataset, unpickled once per worker."""
    return pickle.loads((Path(folder) / DATASET_FILE).read_bytes())
