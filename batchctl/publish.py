"""Publishing a build: the dataset's attributes (`dataset_attrs`), its record (`record_of`: which
file each row came from, for the next, incremental build), and the step that gives the dataset
its content digest, marks it complete and puts it in place (`publish`; `Workdir.publish` makes
it safe to kill).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from batchctl.records import Finished, WorkItem
from batchctl.report import FileError
from batchctl.run.staging import BuildPaths, Workdir
from batchctl.store import metadata as meta
from batchctl.store.digest import content_digest
from batchctl.store.journal import BatchLine
from batchctl.store.record import Record, Skipped, record_bytes
from batchctl.store.zarrmeta import ArrayMeta
from batchctl.version import __version__


@dataclass(frozen=True)
class Origin:
    """What a dataset says of the build that made it."""

    source: str
    spec: Mapping[str, Any]
    batch_size: int
    shard_batches: int | None  # as asked (None: the default); the dataset's is the collator's
    compression: str
    checksum: bool
    classes: list[str] | None
    ignored: int = 0
    ignored_paths: list[str] = field(default_factory=list)


def dataset_attrs(origin: Origin, errors: Sequence[FileError], finished: Finished | None = None) -> meta.DatasetAttrs:
    """The group attributes: of a complete dataset once the engine `finished`, else of the
    staging dataset, `complete` false."""
    samples = finished.samples if finished else 0
    return meta.DatasetAttrs(
        batch_size=origin.batch_size,
        shard_batches=finished.shard_batches if finished else origin.shard_batches or 0,
        # by name: a resumed build's collator learns the fields from the arrays there, a fresh one
        # from its first sample's order, and the attributes must be the same bytes either way
        fields=dict(sorted(finished.schema.items())) if finished else {},
        classes=origin.classes,
        preprocess=origin.spec["preprocess"],
        compression=origin.compression,
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
    source_width: int,
    digests: Mapping[str, str],
    rows: Mapping[str, str],
) -> Record:
    """The record of the dataset being published: its batches (every row's file) and the files
    it skipped, with their stamps (its `build_id`, the digest, is set as it is published)."""
    by_source = {error.source: error for error in errors}
    skipped = {
        item.relpath: Skipped(item.size, item.mtime_ns, by_source[item.relpath].error, by_source[item.relpath].retry)
        for item in (items if by_source else [])
        if item.relpath in by_source
    }
    return Record(
        build_id="",
        spec=origin.spec,
        source=origin.source,
        classes=origin.classes,
        batch_size=origin.batch_size,
        shard_batches=finished.shard_batches,
        source_width=source_width,
        checksum=origin.checksum,
        batches=tuple(batches),  # written without their chunks' places
        skipped=skipped,
        digests=digests,
        rows=rows,
    )


def publish(
    work: Workdir,
    paths: BuildPaths,
    attrs: meta.DatasetAttrs,
    record: Record,
    notes: meta.ArrayNotes,
    fingerprint: str,
    known: Mapping[str, str],
    arrays: Mapping[str, ArrayMeta],
) -> str:
    """Give the staging dataset its final array documents and its digest, then mark it complete
    (its last write) and move it, its record and its build info into place. `notes`: the
    preprocessor's words on its arrays; `fingerprint`: what a rerun finds it up to date by;
    `known`: the shard files' hashes the writers took (the others are read); `arrays`: the staging
    arrays' documents as the engine left them. Returns the digest."""
    files = paths.staging_files
    arrays = meta.describe_arrays(files, arrays, attrs.classes, notes)
    attrs.digest, shards = content_digest(files, arrays, attrs, known)
    raw = record_bytes(replace(record, build_id=attrs.digest))
    info = meta.BuildInfo(
        digest=attrs.digest,
        batchctl_version=__version__,
        source=record.source,
        fingerprint=fingerprint,
        record_sha256=hashlib.sha256(raw).hexdigest(),
        shards=shards,
    )

    def mark_complete() -> None:
        meta.write_dataset_attrs(files, attrs, arrays=arrays)  # consolidates the arrays' documents

    work.publish({meta.RECORD: raw, meta.BUILD_INFO: info.to_bytes()}, attrs.digest, mark_complete)
    return attrs.digest
