"""Incremental builds: what changed in SOURCE since the last build, and which rows survive it.

A complete build leaves a record beside OUTPUT (`.NAME.batchctl.record`): its journal's batch
lines (which file's rows lie in which batch of which shard, with each file's size and mtime),
the files it skipped, and the dataset's `build_id`, which ties the record to the dataset it
describes (a record of any other dataset is ignored). The next run compares SOURCE with it:

- added and changed files are preprocessed; removed files' rows are dropped;
- shards holding no row of a changed or removed file are kept whole (their files are linked or
  copied, never decoded), renumbered to come first;
- the short last shard, when none of its rows changed and the local collator builds on a local
  OUTPUT, is copied byte for byte and kept open: new rows are appended to it;
- the other shards (and a short last shard otherwise) are rewritten: their kept rows are
  carried over by the collator, decoded from the previous dataset, never preprocessed again.

The rewritten part is built exactly like an interrupted build being resumed: the kept shards are
journaled as finished shards, so an interrupted incremental run resumes like any other.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchctl.records import CarryRun, PathKey, WorkItem
from batchctl.store import journal, storage
from batchctl.store.journal import Untrusted
from batchctl.store.metadata import DatasetAttrs

RECORD_VERSION = 1


@dataclass(frozen=True)
class Record:
    """What the last complete build of OUTPUT holds, row by row."""

    build_id: str
    spec: dict[str, Any]
    source: str
    classes: list[str] | None
    batch_size: int
    shard_batches: int
    source_width: int
    checksum: bool
    batches: list[dict[str, Any]]  # journal lines ({"batch", "shard", "rows", "files"}, ...), in order
    skipped: dict[str, list[Any]] = field(default_factory=dict)  # relpath -> [size, mtime_ns, reason, retry]
    digests: dict[str, str] = field(default_factory=dict)  # relpath -> content hash (--checksum)
    sha256: str = ""  # of the record's bytes as read (a resumed incremental build checks it again)

    @property
    def shard_rows(self) -> int:
        return self.batch_size * self.shard_batches

    def stamps(self) -> dict[str, tuple[int, int]]:
        """Each file with rows: its (size, mtime_ns) when it was preprocessed."""
        return {entry[0]: (int(entry[3]), int(entry[4])) for batch in self.batches for entry in batch["files"]}


def record_bytes(record: Record) -> bytes:
    """The record as written beside OUTPUT: a header line, then one line per batch."""
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
        "skipped": record.skipped,
        "digests": record.digests,
    }
    lines = [json.dumps(header)] + [json.dumps(_batch_line(batch)) for batch in record.batches]
    return ("\n".join(lines) + "\n").encode()


def _batch_line(batch: Mapping[str, Any]) -> dict[str, Any]:
    return {"batch": batch["batch"], "shard": batch["shard"], "rows": batch["rows"], "files": batch["files"]}


def _read_regular(path: Path) -> bytes:
    """A regular file's bytes; anything else (a FIFO would block the read for ever) is refused."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Untrusted("it is not a regular file")
        return file.read()


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
        lines = [json.loads(text) for text in raw.decode().splitlines() if text]
    except ValueError:
        raise Untrusted("it is not JSON lines") from None
    if not lines:
        raise Untrusted("it is empty")
    header = journal.check_record_header(lines[0])
    if header.get("record") != RECORD_VERSION:
        raise Untrusted(f"it is of version {header.get('record')!r}, not {RECORD_VERSION}")
    if header["build_id"] != build_id:
        raise Untrusted("it is the record of another build")
    batch_size, shard_batches = header["batch_size"], header["shard_batches"]
    batches = [journal.check_batch(line, batch_size, chunks=False) for line in lines[1:]]
    journal.check_sequence(batches, batch_size, shard_batches)
    return Record(
        build_id=header["build_id"],
        spec=header["spec"],
        source=header["source"],
        classes=header["classes"],
        batch_size=batch_size,
        shard_batches=shard_batches,
        source_width=header["source_width"],
        checksum=header["checksum"],
        batches=batches,
        skipped=header["skipped"],
        digests=header["digests"],
        sha256=digest,
    )


def check_fits(record: Record, attrs: DatasetAttrs, source_width: int) -> None:
    """The record describes `attrs`' dataset row for row: its batch size, shard size, source
    width and counts (raises `Untrusted`)."""
    samples = sum(int(batch["rows"]) for batch in record.batches)
    ours = (record.batch_size, record.shard_batches, record.source_width, samples, len(record.batches))
    theirs = (attrs.batch_size, attrs.shard_batches, source_width, attrs.num_samples, attrs.num_batches)
    if ours != theirs:
        raise Untrusted(
            "it does not describe the dataset: (batch_size, shard_batches, source_width, samples, batches) "
            f"{ours} against the dataset's {theirs}"
        )


@dataclass(frozen=True)
class Changes:
    """Files added, changed (size or mtime, or content with --checksum) and removed since the
    last build, as relative paths in sorted order."""

    added: list[str]
    changed: list[str]
    removed: list[str]
    retried: list[str] = field(default_factory=list)  # skipped last time by a transient failure: tried again

    def line(self) -> str:
        retried = f", {len(self.retried)} retried" if self.retried else ""
        counts = f"{len(self.added)} added, {len(self.changed)} changed, {len(self.removed)} removed{retried}"
        return f"{counts} since the last build"


@dataclass(frozen=True)
class Plan:
    """An incremental build: the changes, the old shards kept whole (in their new order; the last
    one perhaps the short tail, kept open), and the rows carried over from the others (in order)."""

    changes: Changes
    kept_shards: list[int]
    carry: list[CarryRun]
    kept_batches: list[dict[str, Any]]  # journal lines of the kept shards, renumbered
    skipped: dict[str, list[Any]]  # unchanged files the last build skipped: not tried again
    open_tail: bool = False  # the last of `kept_shards` is the short last shard, kept open for new rows

    @property
    def done_shards(self) -> list[int]:
        """The kept shards that are whole (all but an open tail)."""
        return self.kept_shards[:-1] if self.open_tail else self.kept_shards

    @property
    def kept_samples(self) -> int:
        return sum(int(batch["rows"]) for batch in self.kept_batches)

    @property
    def preprocess(self) -> set[str]:
        return set(self.changes.added) | set(self.changes.changed) | set(self.changes.retried)


def compare(
    record: Record, items: Iterable[WorkItem], digests: Mapping[str, str], checksum: bool
) -> tuple[Changes, set[str]]:
    """What changed, and the set of files whose rows (or skip) the last build's record still vouches for."""
    current = {item.relpath: item for item in items}
    known = record.stamps()
    for relpath, (size, mtime_ns, _, retry) in record.skipped.items():
        if not retry:
            known.setdefault(relpath, (int(size), int(mtime_ns)))
    added, changed, unchanged = [], [], set()
    for relpath, item in current.items():
        stamp = known.get(relpath)
        if stamp is None:
            added.append(relpath)
        elif _same(item, stamp, record.digests.get(relpath), digests.get(relpath), checksum):
            unchanged.add(relpath)
        else:
            changed.append(relpath)
    retried = [relpath for relpath, entry in record.skipped.items() if entry[3] and relpath in current]
    again = [relpath for relpath in retried if relpath not in known]
    added = [relpath for relpath in added if relpath not in retried]
    removed = [relpath for relpath in known if relpath not in current]
    return Changes(sorted(added), sorted(changed), sorted(removed), sorted(again)), unchanged


def _same(item: WorkItem, stamp: tuple[int, int], old: str | None, new: str | None, checksum: bool) -> bool:
    """Unchanged: same size and mtime; with --checksum, same size and content hash (a file the last
    build did not hash is trusted on its size and mtime, and hashed from now on)."""
    if item.size != stamp[0]:
        return False
    if checksum and old is not None and new is not None:
        return old == new
    return item.mtime_ns == stamp[1]


def plan(record: Record, items: list[WorkItem], digests: Mapping[str, str], checksum: bool, keep_tail: bool) -> Plan:
    """Which old shards stay whole and which rows are carried over, for the files of `items`.
    `keep_tail`: a short last shard none of whose rows changed is kept too, as the open shard new
    rows are appended to (a local OUTPUT: its files are copied, then grow; an object cannot)."""
    changes, unchanged = compare(record, items, digests, checksum)
    current = {item.relpath: item for item in items}
    shard_rows, batch_size = record.shard_rows, record.batch_size
    runs: list[tuple[int, int, int, str, int, int]] = []  # (shard, start, rows, relpath, first, index)
    seen: dict[PathKey, int] = defaultdict(int)
    shards_of: dict[PathKey, set[int]] = defaultdict(set)
    rows_in: dict[int, int] = defaultdict(int)
    for batch in record.batches:
        shard, position = int(batch["shard"]), (int(batch["batch"]) * batch_size) % shard_rows
        rows_in[shard] += int(batch["rows"])
        for relpath, rows, _, _, _, first in batch["files"]:
            key = (relpath, int(first))
            runs.append((shard, position, int(rows), relpath, int(first), int(first) + seen[key]))
            seen[key] += int(rows)
            shards_of[key].add(shard)
            position += int(rows)
    last = max(rows_in, default=-1)
    short = last >= 0 and rows_in[last] < shard_rows
    dirty = _spread({shard for shard, relpath in ((r[0], r[3]) for r in runs) if relpath not in unchanged}, shards_of)
    if short and (last in dirty or not keep_tail):
        dirty = _spread(dirty | {last}, shards_of)  # the short last shard takes new rows: rewritten
    kept = [shard for shard in sorted(rows_in) if shard not in dirty]
    open_tail = short and last not in dirty
    new_index = {old: new for new, old in enumerate(kept)}
    kept_batches = []
    for batch in record.batches:
        if int(batch["shard"]) in new_index:
            number = new_index[int(batch["shard"])] * record.shard_batches + int(batch["batch"]) % record.shard_batches
            kept_batches.append({**_batch_line(batch), "batch": number, "shard": new_index[int(batch["shard"])]})
    carry = [
        CarryRun(shard, start, rows, current[relpath], first, index)
        for shard, start, rows, relpath, first, index in sorted(runs)
        if shard in dirty and relpath in unchanged
    ]
    skipped = {relpath: entry for relpath, entry in record.skipped.items() if relpath in unchanged}
    return Plan(changes, kept, carry, kept_batches, skipped, open_tail)


def _spread(dirty: set[int], shards_of: Mapping[PathKey, set[int]]) -> set[int]:
    """`dirty` and every shard sharing a part with it: a part with rows in a rewritten shard is
    carried whole, so its other shards are rewritten too."""
    while True:
        spread = {s for shards in shards_of.values() if shards & dirty for s in shards} - dirty
        if not spread:
            return dirty
        dirty = dirty | spread


def remaining_carry(carry: list[CarryRun], written: Mapping[PathKey, tuple[int, bool]]) -> list[CarryRun]:
    """The carry still to do after an interrupted run: parts it finished are left out, and of a
    part it wrote some rows of (always its first rows: a part is carried in sample order), those."""
    out = []
    for run in carry:
        count, finished = written.get(run.key, (0, False))
        if finished:
            continue
        skip = max(0, min(run.rows, run.first + count - run.index))
        if skip < run.rows:
            out.append(CarryRun(run.shard, run.start + skip, run.rows - skip, run.item, run.first, run.index + skip))
    return out
