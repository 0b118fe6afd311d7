"""A task's rows as the dataset stores them, for both engines (the local pool and collator, and
Dask): preprocessing one file, checking a sample's fields against the dataset's schema, and each
row's provenance (its file, its sample number in that file, its label)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from batchctl.errors import PreprocessorError
from batchctl.preprocess import Preprocessor, Sample
from batchctl.preprocess.base import ragged_rows
from batchctl.records import SentTask, Task, TaskOutput, TaskResult, describe_error, parse_ragged_dtype, sent_start
from batchctl.store import format as fmt, metadata
from batchctl.store.storage import SourceRoot

Run = tuple[str, int, int, int]  # rows of one file: (relpath, sample number of the first, label, rows)


def schema_of(sample: Sample) -> metadata.Schema:
    """The fields of one sample, as a dataset's schema."""
    return {name: metadata.FieldSpec.of(value) for name, value in sample.items()}


def columns_schema(columns: Mapping[str, np.ndarray]) -> metadata.Schema:
    """The fields of an output's first row (a ragged field's column holds arrays of rows)."""
    return {
        name: metadata.FieldSpec.ragged_of(column[0]) if ragged_rows(column) else metadata.FieldSpec.of(column[0])
        for name, column in columns.items()
    }


def check_schema(schema: metadata.Schema, found: metadata.Schema) -> str | None:
    """Why a sample of fields `found` does not fit `schema`, or None when it does."""
    if set(found) != set(schema):
        return f"fields {', '.join(sorted(found))} differ from the dataset's {', '.join(sorted(schema))}"
    for name, got in found.items():
        want = schema[name]
        if got != want:
            return f"field {name!r} is {got.describe()}, the dataset's is {want.describe()}"
    return None


def add_table_values(
    preprocessor: Preprocessor, columns: dict[str, np.ndarray], values: tuple[tuple[str, str, Any], ...]
) -> None:
    """The file's metadata row as fields of each of its samples (one value, repeated)."""
    rows = len(next(iter(columns.values())))
    for name, dtype, value in values:
        if name in columns:
            raise PreprocessorError(
                f"preprocessor {preprocessor.name} returned the field {name!r}, which is also a metadata column: "
                "rename one of them"
            )
        columns[name] = _table_column(rows, dtype, value)


def _table_column(rows: int, dtype: str, value: Any) -> np.ndarray:
    """A metadata value repeated for each of the file's rows: a numeric column, or (`ragged:`) a
    ragged field's column of rows."""
    if dtype.startswith("text:"):
        return np.repeat(fmt.encode_sources([value], int(dtype[5:])), rows, axis=0)
    if not dtype.startswith("ragged:"):
        return np.full(rows, value, dtype=dtype)
    kind, trailing = parse_ragged_dtype(dtype)
    row = np.asarray(value, dtype=kind).reshape(-1, *trailing)
    column = np.empty(rows, dtype=object)
    for i in range(rows):  # (assigned one by one: numpy would make a list of equal arrays one array)
        column[i] = row
    return column


NUMERIC_KINDS = "biufc"  # what a field holds: booleans, integers, floats, complex numbers


def check_fields(preprocessor: Preprocessor, columns: Mapping[str, np.ndarray]) -> None:
    """Raise `PreprocessorError` for fields no dataset holds: a name batchctl keeps for itself or
    names its ragged arrays with, or values that are not numbers (a ragged field: its rows')."""
    where = f"preprocessor {preprocessor.name} returned the field"
    for name, column in columns.items():
        if name in metadata.RESERVED_FIELDS:
            raise PreprocessorError(
                f"{where} {name!r}, a name batchctl keeps for itself ({', '.join(metadata.RESERVED_FIELDS)}; "
                "labels come from the class folders): rename it"
            )
        if metadata.ragged_part(name)[1]:
            raise PreprocessorError(f"{where} {name!r}, named as batchctl names a ragged field's arrays: rename it")
        values = column[0] if column.dtype == object and len(column) and isinstance(column[0], np.ndarray) else column
        if values.dtype.kind not in NUMERIC_KINDS:
            raise PreprocessorError(f"{where} {name!r} as {_what(values)}: {_instead(values)}")


def _what(values: np.ndarray) -> str:
    if values.dtype.kind == "U":
        return f"text ({str(values.flat[0])[:40]!r})" if values.size else "text"
    if values.dtype.kind == "S":
        return "bytes"
    if values.dtype.kind == "O" and values.size:
        return f"a {type(values.flat[0]).__name__}"
    return f"values of dtype {values.dtype}"


def _instead(values: np.ndarray) -> str:
    """What to return instead, in a few words."""
    if values.dtype.kind in "US":
        return (
            "a field holds numbers; return the text as numbers (its tokens, or "
            "np.frombuffer(text.encode(), np.uint8) as a ragged field)"
        )
    if values.dtype.kind == "O" and values.size and isinstance(values.flat[0], Mapping):
        return "a field holds numbers; return each of its entries as a field of its own"
    return "a field holds numbers or arrays of numbers"


def runs_of(output: TaskOutput) -> list[Run]:
    return [(task[1], sent_start(task), task[2], rows) for task, rows in output.parts]


def provenance(runs: Sequence[Run]) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Each row's sample number in its file, label and file: a few array operations per call,
    not a few per file (tiny files come 256 to an output)."""
    counts = np.fromiter((run[3] for run in runs), np.int64, len(runs))
    firsts = np.fromiter((run[1] for run in runs), np.int64, len(runs))
    labels = np.fromiter((run[2] for run in runs), np.int64, len(runs))
    total = int(counts.sum())
    if len(runs) == total:  # a row each: the common case of one sample per file
        return firsts, labels, [run[0] for run in runs]
    starts = np.cumsum(counts) - counts  # each run's first row
    source_index = np.arange(total) + np.repeat(firsts - starts, counts)
    return source_index, np.repeat(labels, counts), [run[0] for run in runs for _ in range(run[3])]


def provenance_columns(runs: Sequence[Run], labelled: bool) -> dict[str, np.ndarray]:
    """The `source` (str objects), `source_index` and, for a labelled dataset, `label` columns."""
    source_index, labels, sources = provenance(runs)
    columns = {metadata.SOURCE: np.array(sources, dtype=object), metadata.SOURCE_INDEX: source_index}
    if labelled:
        columns[metadata.LABEL] = labels
    return columns


def preprocess_file(
    task: SentTask, preprocessor: Preprocessor, options: Mapping[str, Any], source: SourceRoot
) -> dict[str, np.ndarray] | str:
    """One file (or part of one): its rows, less those an interrupted run wrote, or the one-line
    reason it is skipped."""
    _, relpath, _, _, _, part, skip, values = task
    path: Path | str = relpath
    try:
        if source.inputs:  # from Python: the function takes the input itself
            columns = preprocessor.columns(source.input_of(relpath), options, part)
        else:
            with source.local_file(relpath) as path:
                columns = preprocessor.columns(path, options, part)
    except Exception as exc:  # noqa: BLE001 - any failure of one file is that file's error
        return describe_error(exc).replace(f" '{path}'", "").replace(str(path), relpath)
    check_fields(preprocessor, columns)  # the preprocessor's fault, not the file's: raised, ending the build
    if values:
        add_table_values(preprocessor, columns, values)
    if skip:
        columns = {name: column[skip:] for name, column in columns.items()}
    return columns


def preprocess_task(
    task: Task, preprocessor: Preprocessor, options: Mapping[str, Any], source: SourceRoot
) -> tuple[TaskResult, TaskOutput | None]:
    """`preprocess_file` for one Task, as a result and its output (none when it has no rows)."""
    sent = task.sent()
    columns = preprocess_file(sent, preprocessor, options, source)
    if isinstance(columns, str):
        return TaskResult(task, 0, columns), None
    rows = len(next(iter(columns.values())))
    return TaskResult(task, rows), TaskOutput([(sent, rows)], columns) if rows else None
