"""The tasks of a build: one per file, or per part of a big file a preprocessor can count;
what an interrupted or earlier build already wrote is left out."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from batchctl.preprocess import Preprocessor
from batchctl.records import PathKey, Task, WorkItem
from batchctl.store import storage
from batchctl.store.journal import Written

PART_BYTES = 16 * 2**20  # big files are split into parts of about this much input
WHOLE: tuple[None] = (None,)  # the one "part" of a file preprocessed whole


def make_tasks(
    preprocessor: Preprocessor,
    options: Mapping[str, Any],
    source: str,
    items: Sequence[WorkItem],
    written: Mapping[PathKey, Written],
    only: Collection[str] | None = None,
) -> list[Task]:
    """One task per file (of `only`, when given), or per part of a big file; a part `written`
    says is finished is left out, and of one it wrote some rows of, those rows are skipped."""
    tasks: list[Task] = []
    splits = preprocessor.count is not None and not storage.is_url(source)
    for item in items:
        if only is not None and item.relpath not in only:
            continue
        for part in _parts(preprocessor, options, source, item) if splits and item.size > PART_BYTES else WHOLE:
            done = written.get((item.relpath, part[0] if part else 0))
            if done is None or not done.finished:
                tasks.append(Task(len(tasks), item, part, skip=done.rows if done else 0))
    return tasks


def _parts(
    preprocessor: Preprocessor, options: Mapping[str, Any], source: str, item: WorkItem
) -> list[tuple[int, int] | None]:
    """Sample ranges of about PART_BYTES of input each, for a big file the preprocessor can count."""
    assert preprocessor.count is not None
    try:
        total = preprocessor.count(Path(source) / item.relpath, **options)
    except Exception:  # noqa: BLE001 - the worker will meet the same problem and report it
        return [None]
    if not total or total < 2:
        return [None]
    per_part = max(1, math.ceil(total * PART_BYTES / item.size))
    return [(start, min(start + per_part, total)) for start in range(0, total, per_part)]
