"""Inputs from Python: `batchctl.build(inputs, output, preprocess=fn)` over any iterable (as
LitData's `optimize(fn, inputs)`) or a map-style dataset (`len` + `__getitem__`, as FFCV's
writer takes: a torchvision or Hugging Face dataset).

A built-in preprocessor takes a list of paths or URLs, opened as a table's `file_name`s are. For
a function of the user's, an iterable's items are pickled as they are met, each into a file of
the spill folder named by its key, so that the workers (which call `fn(item)`) get them without
the parent holding them; an item's row hash is its pickle's (and, for a path, its file's size
and mtime), so an edited item is rebuilt alone. A map-style dataset is pickled once for the
workers, which call `dataset[i]` themselves (the decoding a `__getitem__` does runs in
parallel); its rows are named by index and all change when its pickle does.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchctl.errors import UsageError
from batchctl.records import WorkItem
from batchctl.store.storage import DATASET_FILE, input_file

SOURCE = "python inputs"  # what a dataset built from Python inputs records as its SOURCE


@dataclass(frozen=True)
class PythonInputs:
    """What `build()` was given in place of a SOURCE folder."""

    given: Any
    key: Callable[[Any], str] | None = None

    @property
    def map_style(self) -> bool:
        """A dataset the workers index (not a list, whose items are the inputs themselves)."""
        kind = type(self.given)
        plain = isinstance(self.given, (list, tuple, Mapping))
        return not plain and hasattr(kind, "__len__") and hasattr(kind, "__getitem__")


def is_python_inputs(source: object) -> bool:
    return not isinstance(source, (str, os.PathLike))


def path_inputs(inputs: PythonInputs, taker: str) -> tuple[list[WorkItem], list[tuple[str, str]]]:
    """Inputs that are paths (relative to the current folder) or URLs, for a built-in
    preprocessor, which opens them as a table's `file_name`s: their work items, and those refused
    (no such file, a path given twice)."""
    if inputs.map_style or inputs.key is not None:
        raise UsageError(
            f"the {taker} preprocessor takes a list of paths or URLs; give preprocess= a function of yours"
        )
    items: list[WorkItem] = []
    refused: list[tuple[str, str]] = []
    first: dict[str, int] = {}
    for index, item in enumerate(_iterate(inputs)):
        if not isinstance(item, (str, os.PathLike)):
            raise UsageError(
                f"the {taker} preprocessor takes paths or URLs; input {index} is a {type(item).__name__}: "
                "give preprocess= a function of yours to take it"
            )
        name = os.fspath(item)
        if name in first:
            refused.append((name, f"input {index} names it again (first: input {first[name]})"))
            continue
        first[name] = index
        if "://" in name:  # fetched by the worker that takes it
            items.append(WorkItem(name, -1, 0, 0))
            continue
        try:
            found = os.stat(name)
        except OSError as exc:
            refused.append((name, exc.strerror or str(exc)))
            continue
        items.append(WorkItem(name, -1, found.st_size, found.st_mtime_ns))
    return items, refused


def spill_inputs(inputs: PythonInputs, folder: Path) -> tuple[list[WorkItem], dict[str, str], list[tuple[str, str]]]:
    """The inputs written into `folder` for the workers: their work items, row hashes and the
    inputs refused (a key met twice), in the order given."""
    if inputs.map_style:
        return _spill_dataset(inputs, folder)
    items: list[WorkItem] = []
    hashes: dict[str, str] = {}
    refused: list[tuple[str, str]] = []
    first: dict[str, int] = {}
    for index, item in enumerate(_iterate(inputs)):
        name = _key(inputs, item, index)
        if name in first:
            why = f"input {index} has the key of input {first[name]}; give input_key= a function naming each uniquely"
            refused.append((name, why))
            continue
        first[name] = index
        data = _pickled(item, f"input {index} ({name})")
        input_file(folder, name).write_bytes(data)
        items.append(WorkItem(name, -1, len(data), 0))
        hashes[name] = hashlib.sha256(data + _file_stamp(item)).hexdigest()
    return items, hashes, refused


def _iterate(inputs: PythonInputs) -> Iterator[Any]:
    if isinstance(inputs.given, Mapping):  # (its keys? its values? its items?: the user says which)
        raise UsageError("build() takes an iterable of inputs, not a dict: give it the dict's .values() or .items()")
    try:
        return iter(inputs.given)
    except TypeError:
        raise UsageError(
            f"build() takes a SOURCE path or an iterable of inputs, got {type(inputs.given).__name__}"
        ) from None


def _spill_dataset(inputs: PythonInputs, folder: Path) -> tuple[list[WorkItem], dict[str, str], list[tuple[str, str]]]:
    if inputs.key is not None:
        raise UsageError(
            "input_key= names the items of an iterable; a map-style dataset's rows are named by their index"
        )
    data = _pickled(inputs.given, f"the dataset ({type(inputs.given).__name__})")
    (folder / DATASET_FILE).write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    count = len(inputs.given)
    items = [WorkItem(str(i), -1, 0, 0) for i in range(count)]
    return items, dict.fromkeys((item.relpath for item in items), digest), []


def _key(inputs: PythonInputs, item: Any, index: int) -> str:
    """An input's stable name: `input_key(item)`, a path's or URL's text, an int's digits, else its index."""
    if inputs.key is not None:
        name = inputs.key(item)
        if not isinstance(name, str) or not name or "\0" in name:
            raise UsageError(f"input_key= must give each input a non-empty str; for input {index} it gave {name!r}")
        return name
    if isinstance(item, (str, os.PathLike)):
        return os.fspath(item) or str(index)
    return str(item) if type(item) is int else str(index)


def _pickled(value: Any, what: str) -> bytes:
    try:
        return pickle.dumps(value, protocol=5)
    except Exception as exc:  # noqa: BLE001 - any object may refuse pickling, each its own way
        raise UsageError(f"{what} cannot be pickled for the workers: {type(exc).__name__}: {exc}") from None


def _file_stamp(item: Any) -> bytes:
    """A local file's size and mtime, for an input that names one: an edited file is a changed input."""
    if not isinstance(item, (str, os.PathLike)) or "://" in os.fspath(item):
        return b""
    try:
        found = os.stat(item)
    except (OSError, ValueError):
        return b""
    return f"\0{found.st_size}:{found.st_mtime_ns}".encode()
