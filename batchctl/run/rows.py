"""A task's rows as the dataset stores them, for both engines (the local pool and collator, and
Dask): preprocessing one file, checking a sample's fields against the dataset's schema, and each
row's provenance (its file, its sample number in that file, its label)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from batchctl.preprocess import Preprocessor, Sample
from batchctl.preprocess.base import ragged_rows
from batchctl.records import SentTask, Task, TaskOutput, TaskResult, describe_error, sent_start
from batchctl.store import metadata
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
    taken = sorted(set(found) & set(metadata.RESERVED_FIELDS))
    if taken:
        return f"field names {', '.join(taken)} are batchctl's own; rename them in the preprocessor"
    odd = sorted(name for name in found if metadata.ragged_part(name)[1])
    if odd:
        return f"field name {odd[0]!r} ends as a ragged field's arrays are named; rename it in the preprocessor"
    if set(found) != set(schema):
        return f"fields {', '.join(sorted(found))} differ from the dataset's {', '.join(sorted(schema))}"
    for name, got in found.items():
        want = schema[name]
        if got != want:
            return f"field {name!r} is {got.describe()}, the dataset's is {want.describe()}"
    return None


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
    _, relpath, _, _, _, part, skip = task
    path: Path | str = relpath
    try:
        with source.local_file(relpath) as path:
            columns = preprocessor.columns(path, options, part)
    except Exception as exc:  # noqa: BLE001 - any failure of one file is that file's error
        return describe_error(exc).replace(f" '{path}'", "").replace(str(path), relpath)
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
