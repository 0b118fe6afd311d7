"""The record a complete dataset holds (`OUTPUT/batchctl.record`): which file each row came
from, the files the build skipped, and the options it was built with. The next build reads it to
build incrementally (`batchctl.plan.incremental`); docs/format.md, "The record", is its form.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from batchctl.store import storage
from batchctl.store.journal import (
    MAX_COUNT,
    BatchLine,
    Untrusted,
    check_classes,
    check_sequence,
    mapping,
    parse_batch,
    text,
    to_json,
    whole,
)
from batchctl.store.metadata import DatasetAttrs
from batchctl.store.untrusted import LOG_BYTES, NotRegularFile, parse_json, read_regular

RECORD_VERSION = 1


class Skipped(NamedTuple):
    """A file the build skipped: its stamp, why, and whether the next build tries it again (a
    transient failure); stored as the JSON list `[size, mtime_ns, reason, retry]`."""

    size: int
    mtime_ns: int
    reason: str
    retry: bool


@dataclass(frozen=True)
class Record:
    """What the last complete build of OUTPUT holds, row by row."""

    build_id: str
    spec: Mapping[str, Any]
    source: str
    classes: list[str] | None
    batch_size: int
    shard_batches: int
    source_width: int
    checksum: bool
    batches: tuple[BatchLine, ...]  # in order, without their chunks' places
    skipped: Mapping[str, Skipped] = field(default_factory=dict)
    digests: Mapping[str, str] = field(default_factory=dict)  # relpath -> content hash (--checksum)
    rows: Mapping[str, str] = field(default_factory=dict)  # relpath -> its metadata table row's hash
    sha256: str = ""  # of the record's bytes as read (a resumed incremental build checks it again)

    @property
    def shard_rows(self) -> int:
        return self.batch_size * self.shard_batches

    @property
    def samples(self) -> int:
        return sum(batch.rows for batch in self.batches)

    def stamps(self) -> dict[str, tuple[int, int]]:
        """Each file with rows: its (size, mtime_ns) when it was preprocessed."""
        return {run.source: (run.size, run.mtime_ns) for batch in self.batches for run in batch.files}


def record_bytes(record: Record) -> bytes:
    """The record as it is written: a header line, then one line per batch."""
    header = {
        "record": RECORD_VERSION,
        "build_id": record.build_id,
        "spec": record.spec,
        "source": record.source,
        "classes": record.classes,
        "batch_size": record.batch_size,
        "shard_batches": record.shard_batches,
        "source_width": record.source_width,
        "checksum": record.checksum,
        "skipped": {relpath: list(entry) for relpath, entry in record.skipped.items()},
        "digests": record.digests,
    } | ({"rows": record.rows} if record.rows else {})
    lines = [json.dumps(header)] + [json.dumps(to_json(batch, chunks=False)) for batch in record.batches]
    return ("\n".join(lines) + "\n").encode()


def read_record(where: str, storage_options: Mapping[str, Any], build_id: str, sha256: str) -> Record | None:
    """The record at `where` of the dataset `build_id` whose record hashes to `sha256` (empty:
    a dataset of an older batchctl, which did not say), or None when there is none. Raises
    `Untrusted`, saying why, for a record that is not that dataset's or not of batchctl's form."""
    try:
        if storage.is_url(where):
            raw = storage.filesystem(where, storage_options).cat_file(storage.fs_path(where))
        else:
            raw = _read_regular(Path(where))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise Untrusted(f"it cannot be read ({exc.strerror or exc})") from None
    digest = hashlib.sha256(raw).hexdigest()
    if sha256 and digest != sha256:
        raise Untrusted("its contents are not those the dataset was published with")
    try:
        lines = [parse_json(line) for line in raw.decode().splitlines() if line]
    except ValueError:
        raise Untrusted("it is not JSON lines") from None
    if not lines:
        raise Untrusted("it is empty")
    head = mapping(lines[0], "the header")
    if head.get("record") != RECORD_VERSION:
        raise Untrusted(f"it is of version {head.get('record')!r}, not {RECORD_VERSION}")
    if text(head.get("build_id"), "build_id") != build_id:
        raise Untrusted("it is the record of another build")
    batch_size = whole(head.get("batch_size"), "batch_size", 1)
    shard_batches = whole(head.get("shard_batches"), "shard_batches", 1)
    batches = tuple(parse_batch(line, batch_size, chunks=False) for line in lines[1:])
    check_sequence(batches, batch_size, shard_batches)
    if not isinstance(head.get("checksum"), bool):
        raise Untrusted(f"checksum is {head.get('checksum')!r}")
    digests = mapping(head.get("digests"), "digests")
    for relpath, found in digests.items():
        text(found, f"the digest of {relpath!r}")
    rows = mapping(head.get("rows", {}), "rows")
    for relpath, found in rows.items():
        text(found, f"the metadata row hash of {relpath!r}")
    return Record(
        build_id=build_id,
        spec=mapping(head.get("spec"), "spec"),
        source=text(head.get("source"), "source"),
        classes=check_classes(head.get("classes")),
        batch_size=batch_size,
        shard_batches=shard_batches,
        source_width=whole(head.get("source_width"), "source_width", 1),
        checksum=head["checksum"],
        batches=batches,
        skipped=_skipped(head.get("skipped")),
        digests=digests,
        rows=rows,
        sha256=digest,
    )


def _skipped(value: Any) -> dict[str, Skipped]:
    found = {}
    for relpath, entry in mapping(value, "skipped").items():
        if not isinstance(entry, list) or len(entry) != 4:
            raise Untrusted(f"the skipped entry of {relpath!r} is {entry!r}, not [size, mtime_ns, reason, retry]")
        if not isinstance(entry[2], str) or not isinstance(entry[3], bool):
            raise Untrusted(f"the skipped entry of {relpath!r} is {entry!r}")
        size = whole(entry[0], "a skipped file's size")
        found[relpath] = Skipped(size, whole(entry[1], "a skipped file's mtime_ns", -MAX_COUNT), entry[2], entry[3])
    return found


def check_fits(record: Record, attrs: DatasetAttrs, source_width: int) -> None:
    """The record describes `attrs`' dataset row for row: its batch size, shard size, source
    width and counts (raises `Untrusted`)."""
    ours = (record.batch_size, record.shard_batches, record.source_width, record.samples, len(record.batches))
    theirs = (attrs.batch_size, attrs.shard_batches, source_width, attrs.num_samples, attrs.num_batches)
    if ours != theirs:
        raise Untrusted(
            "it does not describe the dataset: (batch_size, shard_batches, source_width, samples, batches) "
            f"{ours} against the dataset's {theirs}"
        )


def _read_regular(path: Path) -> bytes:
    """A regular file's bytes; anything else (a FIFO would block the read for ever) is refused."""
    try:
        return read_regular(path, LOG_BYTES, follow=False)
    except NotRegularFile:
        raise Untrusted("it is not a regular file") from None
