"""Publishing a build: the dataset's attributes (`dataset_attrs`), its record (`record_of`: which
file each row came from, for the next, incremental build), and the step that marks the staging
dataset complete and puts it in place (`publish`; `Workdir.publish` makes it safe to kill).
"""

from __future__ import annotations

import datetime as dt
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from batchctl.records import Finished, WorkItem
from batchctl.report import FileError
from batchctl.run.staging import BuildPaths, Workdir
from batchctl.store import metadata as meta
from batchctl.store.journal import BatchLine
from batchctl.store.record import Record, Skipped, record_bytes
from batchctl.version import __version__


@dataclass(frozen=True)
class Origin:
    """What a dataset says of the build that made it."""

    build_id: str
    source: str
    spec: Mapping[str, Any]
    batch_size: int
    shard_batches: int | None  # as asked (None: the default); the dataset's is the collator's
    compression: str
    checksum: bool
    classes: list[str] | None
    ignored: int = 0
    ignored_paths: list[str] = field(default_factory=list)


def dataset_attrs(
    origin: Origin, errors: Sequence[FileError], fingerprint: str = "", finished: Finished | None = None
) -> meta.DatasetAttrs:
    """The group attributes: of a complete dataset once the engine `finished`, else of the
    staging dataset, `complete` false."""
    samples = finished.samples if finished else 0
    return meta.DatasetAttrs(
        batch_size=origin.batch_size,
        shard_batches=finished.shard_batches if finished else origin.shard_batches or 0,
        fields=finished.schema if finished else {},
        classes=origin.classes,
        preprocess=origin.spec["preprocess"],
        compression=origin.compression,
        batchctl_version=__version__,
        created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        source=origin.source,
        fingerprint=fingerprint,
        build_id=origin.build_id,
        complete=finished is not None,
        num_samples=samples,
        num_batches=meta.num_batches(samples, origin.batch_size),
        num_shards=finished.shards if finished else 0,
        errors=len(errors),
        ignored=origin.ignored,
        ignored_paths=origin.ignored_paths,
        skipped=[[error.source, error.error] for error in errors[: meta.MAX_SKIPPED_LISTED]],
    )


def record_of(
    origin: Origin,
    batches: Sequence[BatchLine],
    finished: Finished,
    items: Sequence[WorkItem],
    errors: Sequence[FileError],
    paths: BuildPaths,
    digests: Mapping[str, str],
) -> Record:
    """The record of the dataset being published: its batches (every row's file) and the files
    it skipped, with their stamps."""
    by_source = {error.source: error for error in errors}
    skipped = {
        item.relpath: Skipped(item.size, item.mtime_ns, by_source[item.relpath].error, by_source[item.relpath].retry)
        for item in (items if by_source else [])
        if item.relpath in by_source
    }
    return Record(
        build_id=origin.build_id,
        spec=origin.spec,
        source=origin.source,
        classes=origin.classes,
        batch_size=origin.batch_size,
        shard_batches=finished.shard_batches,
        source_width=paths.staging_files.arrays()[meta.SOURCE].shape[1],
        checksum=origin.checksum,
        batches=tuple(batches),  # written without their chunks' places
        skipped=skipped,
        digests=digests,
    )


def publish(
    work: Workdir,
    paths: BuildPaths,
    attrs: meta.DatasetAttrs,
    record: Record,
    notes: meta.ArrayNotes,
) -> None:
    """Mark the staging dataset complete (its last write, naming its record's hash), then move
    it and its record into place. `notes`: the preprocessor's words on its arrays."""
    raw = record_bytes(record)
    attrs.record_sha256 = hashlib.sha256(raw).hexdigest()

    def mark_complete() -> None:
        arrays = meta.describe_arrays(paths.staging_files, attrs.classes, notes)
        meta.write_dataset_attrs(paths.staging_files, attrs, arrays=arrays)  # consolidates them

    work.publish(raw, record.build_id, mark_complete)
