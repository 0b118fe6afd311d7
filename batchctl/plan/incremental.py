"""Incremental builds: what changed in SOURCE since the last build, and which rows survive it.

A complete dataset holds its record (`batchctl.store.record`): its batches (which file's rows
lie in which batch of which shard, with each file's size and mtime), the files it skipped, and
the dataset's `build_id`, which ties the record to the dataset it describes (a record of any
other dataset is ignored). The next run compares SOURCE with it:

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

from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace

from batchctl.records import CarryRun, PathKey, WorkItem
from batchctl.store.journal import BatchLine
from batchctl.store.record import Record, Skipped


@dataclass(frozen=True)
class Changes:
    """Files added, changed (size or mtime, or content with --checksum) and removed since the
    last build, as relative paths in sorted order."""

    added: list[str]
    changed: list[str]
    removed: list[str]
    retried: list[str] = field(default_factory=list)  # skipped last time by a transient failure: tried again
    redone: list[str] = field(default_factory=list)  # unchanged, but their rows lay in a damaged shard

    def line(self) -> str:
        retried = f", {len(self.retried)} retried" if self.retried else ""
        redone = f", {len(self.redone)} preprocessed again (damaged shards)" if self.redone else ""
        counts = f"{len(self.added)} added, {len(self.changed)} changed, {len(self.removed)} removed{retried}{redone}"
        return f"{counts} since the last build"


@dataclass(frozen=True)
class Plan:
    """An incremental build: the changes, the old shards kept whole (in their new order; the last
    one perhaps the short tail, kept open), and the rows carried over from the others (in order)."""

    changes: Changes
    kept_shards: list[int]
    carry: list[CarryRun]
    kept_batches: tuple[BatchLine, ...]  # the batches of the kept shards, renumbered
    skipped: Mapping[str, Skipped]  # unchanged files the last build skipped: not tried again
    open_tail: bool = False  # the last of `kept_shards` is the short last shard, kept open for new rows

    @property
    def done_shards(self) -> list[int]:
        """The kept shards that are whole (all but an open tail)."""
        return self.kept_shards[:-1] if self.open_tail else self.kept_shards

    @property
    def kept_samples(self) -> int:
        return sum(batch.rows for batch in self.kept_batches)

    @property
    def preprocess(self) -> set[str]:
        changes = self.changes
        return set(changes.added) | set(changes.changed) | set(changes.retried) | set(changes.redone)


def compare(
    record: Record,
    items: Iterable[WorkItem],
    digests: Mapping[str, str],
    checksum: bool,
    rows: Mapping[str, str] | None = None,
) -> tuple[Changes, set[str]]:
    """What changed, and the set of files whose rows (or skip) the last build's record still
    vouches for. A file whose metadata table row (`rows`: its hash) changed has changed."""
    rows = rows or {}
    current = {item.relpath: item for item in items}
    known = record.stamps()
    for relpath, skipped in record.skipped.items():
        if not skipped.retry:
            known.setdefault(relpath, (skipped.size, skipped.mtime_ns))
    added, changed, unchanged = [], [], set()
    for relpath, item in current.items():
        stamp = known.get(relpath)
        if stamp is None:
            added.append(relpath)
        elif record.rows.get(relpath) == rows.get(relpath) and _same(
            item, stamp, record.digests.get(relpath), digests.get(relpath), checksum
        ):
            unchanged.add(relpath)
        else:
            changed.append(relpath)
    retried = [relpath for relpath, skipped in record.skipped.items() if skipped.retry and relpath in current]
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


def plan(
    record: Record,
    items: list[WorkItem],
    digests: Mapping[str, str],
    checksum: bool,
    keep_tail: bool,
    damaged: Collection[int] = (),
    rows: Mapping[str, str] | None = None,
) -> Plan:
    """Which old shards stay whole and which rows are carried over, for the files of `items`.
    `keep_tail`: a short last shard none of whose rows changed is kept too, as the open shard new
    rows are appended to (a local OUTPUT: its files are copied, then grow; an object cannot).
    `damaged`: shards whose files are not what the last build wrote: neither kept nor carried
    from, their files preprocessed again."""
    changes, unchanged = compare(record, items, digests, checksum, rows)
    lost = {run.source for batch in record.batches if batch.shard in damaged for run in batch.files}
    redone = sorted(lost & unchanged)
    unchanged -= lost
    changes = replace(changes, redone=redone)
    current = {item.relpath: item for item in items}
    shard_rows, batch_size = record.shard_rows, record.batch_size
    runs: list[tuple[int, int, int, str, int, int]] = []  # (shard, start, rows, relpath, first, index)
    seen: dict[PathKey, int] = defaultdict(int)
    shards_of: dict[PathKey, set[int]] = defaultdict(set)
    rows_in: dict[int, int] = defaultdict(int)
    for batch in record.batches:
        shard, position = batch.shard, (batch.batch * batch_size) % shard_rows
        rows_in[shard] += batch.rows
        for run in batch.files:
            runs.append((shard, position, run.rows, run.source, run.first, run.first + seen[run.key]))
            seen[run.key] += run.rows
            shards_of[run.key].add(shard)
            position += run.rows
    last = max(rows_in, default=-1)
    short = last >= 0 and rows_in[last] < shard_rows
    dirty = _spread({shard for shard, relpath in ((r[0], r[3]) for r in runs) if relpath not in unchanged}, shards_of)
    if short and (last in dirty or not keep_tail):
        dirty = _spread(dirty | {last}, shards_of)  # the short last shard takes new rows: rewritten
    kept = [shard for shard in sorted(rows_in) if shard not in dirty]
    open_tail = short and last not in dirty
    new_index = {old: new for new, old in enumerate(kept)}
    kept_batches = tuple(
        replace(
            batch,
            batch=new_index[batch.shard] * record.shard_batches + batch.batch % record.shard_batches,
            shard=new_index[batch.shard],
        )
        for batch in record.batches
        if batch.shard in new_index
    )
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
