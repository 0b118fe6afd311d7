"""`batchctl build`'s options: `BuildOptions` (checked as they are made), `build()`'s keywords
(`BuildKwargs`, the CLI's names and the fields themselves) and the part of them that decides what
a dataset holds (`dataset_spec`: a change to it means a rebuild)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict

from batchctl.errors import FormatError, UsageError
from batchctl.preprocess import PreprocessFn, Preprocessor, portable_name, spec_of
from batchctl.store import metadata as meta, storage


def default_workers() -> int:
    return len(os.sched_getaffinity(0))


@dataclass(frozen=True)
class BuildOptions:
    """Everything `batchctl build` takes besides SOURCE and OUTPUT."""

    batch_size: int = 64
    workers: int = field(default_factory=default_workers)
    preprocess: str = "image"
    preprocess_options: Mapping[str, Any] = field(default_factory=dict)
    seed: int | None = 0  # files are dispatched in this shuffled order; None: in sorted order
    shard_batches: int | None = None
    compression: str = "auto"
    max_errors: int | None = None
    resume: bool = True
    force: bool = False
    checksum: bool = False  # files are unchanged when their contents hash the same (else: size and mtime)
    timeout: float | None = None
    include: tuple[str, ...] = ()
    label: str | None = None  # the metadata tables' column of class labels (names or whole numbers)
    path_column: str = "file_name"  # a table's column naming each file
    storage_options: Mapping[str, Any] = field(default_factory=dict)  # for a URL OUTPUT (fsspec)
    engine: str = "local"  # or "dask": a dask.distributed cluster preprocesses and writes shards
    scheduler: str | None = None  # the Dask scheduler's address; None starts a local cluster

    def __post_init__(self) -> None:
        if self.timeout is not None and not self.timeout > 0:
            raise UsageError(f"Expected timeout > 0 seconds, got {self.timeout!r} instead.")
        _positive("batch_size", self.batch_size)
        _positive("workers", self.workers)
        if self.shard_batches is not None:
            _positive("shard_batches", self.shard_batches)
        if self.max_errors is not None and self.max_errors < 0:
            raise UsageError(f"Expected max_errors >= 0, got {self.max_errors} instead.")
        if self.engine not in ("local", "dask"):
            raise UsageError(f"Expected engine local or dask, got {self.engine!r} instead.")
        if self.scheduler and self.engine != "dask":
            raise UsageError("--scheduler needs --engine dask.")
        try:
            meta.parse_compression(self.compression)
        except FormatError as exc:
            raise UsageError(str(exc)) from None


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise UsageError(f"Expected {name} to be a positive integer, got {value!r} instead.")


def dataset_spec(options: BuildOptions, preprocessor: Preprocessor, pp_options: Mapping[str, Any]) -> dict[str, Any]:
    """The options that decide what the dataset holds: a change to any of them means a rebuild."""
    return {
        "format_version": meta.FORMAT_VERSION,
        "batch_size": options.batch_size,
        "shard_batches": options.shard_batches,
        "compression": options.compression,
        "preprocess": {
            "name": portable_name(preprocessor.name),
            "options": dict(pp_options),
            "code": preprocessor.code,
        },
        "include": list(options.include),
    } | _table_spec(options)


def _table_spec(options: BuildOptions) -> dict[str, Any]:
    """The table options, where given (a dataset built without them keeps the spec it had)."""
    found: dict[str, Any] = {} if options.label is None else {"label": options.label}
    return found | ({} if options.path_column == "file_name" else {"path_column": options.path_column})


class BuildKwargs(TypedDict, total=False):
    """`build()`'s keyword arguments: every `batchctl build` option under its own name, with its
    meaning (`strict`, `sorted`, `resize`, `option`, `storage_option`, `report`, `quiet`, ...),
    and the fields of `BuildOptions` they come down to (`max_errors`, `preprocess_options`, ...).
    Tests keep both sets here."""

    batch_size: int
    workers: int
    preprocess: str | PreprocessFn  # a built-in's name, "module:function", or (from Python) the function
    preprocess_options: Mapping[str, object]
    seed: int | None
    shard_batches: int | None
    compression: str
    max_errors: int | None
    resume: bool
    force: bool
    checksum: bool
    timeout: float | None
    include: Sequence[str]
    label: str | None
    path_column: str
    storage_options: Mapping[str, object]
    engine: str
    scheduler: str | None
    # the CLI's own spellings
    strict: bool  # max_errors=0
    sorted: bool  # seed=None: files dispatched in path order
    resize: int
    crop: int
    layout: str
    store: str
    max_side: int
    quality: int
    sample_rate: int
    clip_seconds: float
    key: str
    split_rows: bool
    option: Mapping[str, object] | Sequence[str]  # preprocessor options: a dict, or "key=value" texts
    storage_option: Mapping[str, object] | Sequence[str]  # fsspec options: a dict, or "key=value" texts
    report: str | os.PathLike[str]  # the JSON report, written whatever the outcome
    quiet: bool  # print progress and the summary as the CLI does (False), or errors only (True)


PREPROCESS_FLAGS = (
    "resize",
    "crop",
    "layout",
    "store",
    "max_side",
    "quality",
    "sample_rate",
    "clip_seconds",
    "key",
    "split_rows",
)


def parse_option(text: str) -> tuple[str, Any]:
    """`key=value` with value read as JSON when it parses (numbers, true/false), else as text."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise UsageError(f"Expected --option key=value, got {text!r} instead.")
    try:
        return key, json.loads(raw)
    except ValueError:
        return key, raw


def build_options(**given: Any) -> BuildOptions:
    """`BuildOptions` from `build()`'s keywords (the CLI's names or the fields themselves)."""
    kwargs = dict(given)
    if kwargs.pop("strict", False):
        if kwargs.get("max_errors") not in (None, 0):
            raise UsageError(f"strict means max_errors=0; got max_errors={kwargs['max_errors']!r} too.")
        kwargs["max_errors"] = 0
    if kwargs.pop("sorted", False):
        kwargs["seed"] = None
    if callable(kwargs.get("preprocess")):  # a Python function: the workers import it by name
        kwargs["preprocess"] = spec_of(kwargs["preprocess"])
    pp_options = dict(kwargs.pop("preprocess_options", None) or {})
    pp_options.update(_key_values(kwargs.pop("option", None), lambda text: dict([parse_option(text)])))
    for name in PREPROCESS_FLAGS:
        value = kwargs.pop(name, None)
        if value is not None and value is not False:
            pp_options[name] = value
    kwargs["preprocess_options"] = pp_options
    store = dict(kwargs.pop("storage_options", None) or {})
    store.update(_key_values(kwargs.pop("storage_option", None), lambda text: storage.parse_storage_options([text])))
    kwargs["storage_options"] = store
    kwargs["include"] = tuple(kwargs.get("include") or ())
    known = {f.name for f in dataclasses.fields(BuildOptions)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        names = sorted(known | set(BuildKwargs.__annotations__) - {"report", "quiet"})
        raise UsageError(f"build() takes no option {', '.join(unknown)}; its options are {', '.join(names)}.")
    return BuildOptions(**kwargs)


def _key_values(given: Any, parse: Callable[[str], Mapping[str, Any]]) -> dict[str, Any]:
    """A dict as it is, or "key=value" texts parsed one by one."""
    if given is None:
        return {}
    if isinstance(given, Mapping):
        return dict(given)
    found: dict[str, Any] = {}
    for text in [given] if isinstance(given, str) else given:
        found.update(parse(text))
    return found
