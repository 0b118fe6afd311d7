"""Planning a build's start: resume the interrupted build, build incrementally on the published
dataset, or start afresh; and with it what is kept, what is carried over and what is redone.

`plan_resume` and `plan_start` are pure functions of what this run asks (`Request`) and what was
read from disk before (`Interrupted`: the work an interrupted build left; `Published`: the dataset
at OUTPUT and its record), so every case is tested directly (tests/test_start.py). The builder
asks `plan_resume` first, which needs no published facts, and reads those only when no resume is
made; `batchctl.prepare` reads the facts and sets the work folder up as the `Start` says.

Whether OUTPUT is already up to date is decided before (a fingerprint: `batchctl.build`).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from batchctl.errors import ResumeMismatchError
from batchctl.plan import incremental
from batchctl.plan.incremental import Changes, Plan
from batchctl.records import CarryRun, WorkItem
from batchctl.store import storage
from batchctl.store.journal import (
    BatchLine,
    Chunk,
    Journaled,
    Line,
    Seeded,
    ShardDone,
    State,
    Untrusted,
    Written,
    resolve,
)
from batchctl.store.metadata import DatasetAttrs
from batchctl.store.record import Record, Skipped, check_fits
from batchctl.store.zarrmeta import ArrayMeta


@dataclass(frozen=True)
class Request:
    """What this run asks for: its options' spec, SOURCE and what discovery found there."""

    spec: Mapping[str, Any]
    source: str
    classes: list[str] | None
    items: Sequence[WorkItem]
    batch_size: int
    engine: str = "local"
    resume: bool = True
    force: bool = False
    checksum: bool = False
    digests: Mapping[str, str] = field(default_factory=dict)  # --checksum: each input's content hash
    row_hashes: Mapping[str, str] = field(default_factory=dict)  # each input's metadata table row's hash
    keep_tail: bool = True  # a short last shard may be kept open (the local engine on a local OUTPUT)
    carry_from: str = ""  # where an incremental build reads the rows it carries over
    work_url: str = ""  # the work folder, for messages
    record_url: str = ""  # the published record, for messages

    @functools.cached_property
    def tables(self) -> str:
        """One hash of every input's metadata row ("": no tables): a resume needs the same."""
        if not self.row_hashes:
            return ""
        return hashlib.sha256("".join(f"{k}\0{v}\n" for k, v in sorted(self.row_hashes.items())).encode()).hexdigest()


@dataclass(frozen=True)
class Interrupted:
    """What an interrupted build left in the work folder."""

    state: State
    journal: Journaled = Journaled()  # its journal, resolved (all of it: nothing checked against the files)
    problem: str = ""  # why the journal is not of batchctl's form ("" when it is)
    arrays: tuple[str, ...] = ()  # the staging dataset's arrays (none: it never created them)
    shard_sizes: Mapping[tuple[str, int], int] = field(default_factory=dict)  # (array, shard) -> bytes there
    partial_decodes: bool = False  # its half-filled batch reads back whole from its shard files
    groups_present: frozenset[int] = frozenset()  # --engine dask: groups whose shard or spill is there
    record: Record | None = None  # an incremental build's: the record it builds on, read again
    record_problem: str = ""  # why that record is not used ("gone", or not what it was)


@dataclass(frozen=True)
class Published:
    """The complete (or not) dataset at OUTPUT, and its record."""

    attrs: DatasetAttrs | None = None
    record: Record | None = None
    record_problem: str = ""  # why its record is not used ("" when none is there or it is fine)
    source_width: int = 0  # its `source` column's width
    tail_chunks: Mapping[str, tuple[Chunk, ...]] = field(default_factory=dict)  # its short last shard's chunks
    shard_hashes: Mapping[int, Mapping[str, str]] = field(default_factory=dict)  # shard -> {array: its file's hash}
    damaged: Mapping[int, str] = field(default_factory=dict)  # shard -> why its files are not what was written
    arrays: Mapping[str, ArrayMeta] = field(default_factory=dict)  # its arrays' documents, as read


@dataclass(frozen=True)
class Seed:
    """How an incremental build sets its staging dataset up from the published one: the shards it
    keeps (published numbers, in their new order), the first `whole` of them finished and the one
    after, if any, the short last shard kept open (copied, to grow); the shards whose rows it
    carries; the journal it starts with."""

    kept_shards: tuple[int, ...]
    whole: int
    carried_shards: tuple[int, ...]
    lines: tuple[Line, ...]


@dataclass(frozen=True)
class Start:
    """Where a build starts: `fresh`, a `resume` of the interrupted build, or `incremental` on the
    published one (a resumed incremental build is a `resume` whose state says so)."""

    how: str
    state: State  # the work folder's state.json: written before any work (a resume keeps it)
    kept: Journaled = Journaled()  # what is kept: the journal the work folder keeps
    only: frozenset[str] | None = None  # preprocess only these files (an incremental build)
    carry: tuple[CarryRun, ...] = ()  # rows carried over from the published dataset, in order
    carry_shard_rows: int = 0
    seed: Seed | None = None
    notes: tuple[str, ...] = ()  # what the user is told about the choice, in order
    changes: Changes | None = None
    skipped: Mapping[str, Skipped] = field(default_factory=dict)  # unchanged files the last build skipped
    resumed_shards: int = 0
    resumed_samples: int = 0
    kept_samples: int = 0  # rows kept or carried from the published dataset

    def written(self) -> dict[tuple[str, int], Written]:
        return self.kept.written()


def plan_resume(request: Request, interrupted: Interrupted | None) -> Start | None:
    """The start that resumes the interrupted build of the same options, or None when none is
    made (`plan_start` then plans from the published dataset). Raises `ResumeMismatchError` for an
    interrupted build of other options, `Untrusted` for work that is not what batchctl wrote."""
    return _plan_resume(request, interrupted, [])


def plan_start(request: Request, interrupted: Interrupted | None, published: Published) -> Start:
    """Resume the interrupted build of the same options (as `plan_resume`: then `published` is not
    looked at), else build on the last complete build, else start afresh."""
    notes: list[str] = []
    resumed = _plan_resume(request, interrupted, notes)
    if resumed is not None:
        return resumed
    found = _incremental_plan(request, published, notes)
    if found is not None:
        plan, record = found
        seed, state = _seed(request, plan, record, published)
        kept = resolve(seed.lines, request.batch_size)  # every kept shard is there: it was just put there
        started = _resumed(request, state, kept, (plan, record), None, notes)
        if started is not None:
            return replace(started, how="incremental", seed=seed)
    fresh = State(request.spec, request.source, request.classes, request.engine, tables=request.tables)
    return Start("fresh", fresh, notes=tuple(notes))


def untrusted_work(work_url: str, why: Untrusted) -> Untrusted:
    """The one line for interrupted work that is not what batchctl wrote, read or planned."""
    return Untrusted(
        f"the interrupted build's work in {work_url} is not what batchctl wrote ({why}); "
        "rerun with --no-resume to start over"
    )


def _plan_resume(request: Request, interrupted: Interrupted | None, notes: list[str]) -> Start | None:
    if not request.resume or interrupted is None:
        return None
    try:
        return _resume_interrupted(request, interrupted, notes)
    except Untrusted as exc:
        raise untrusted_work(request.work_url, exc) from None


def _resume_interrupted(request: Request, interrupted: Interrupted, notes: list[str]) -> Start | None:
    state = interrupted.state
    if state.spec != request.spec or state.source != request.source:
        was, now = {**state.spec, "source": state.source}, {**request.spec, "source": request.source}
        diffs = "; ".join(differences(was, now))
        if not _kept_work(interrupted):  # nothing to lose (every file skipped, say, and the plugin fixed)
            notes.append(f"the interrupted build kept no samples and used other options ({diffs}); starting over")
            return None
        raise ResumeMismatchError(
            f"an interrupted build of this output used other options ({diffs}): rerun with the same options "
            "to resume, or pass --no-resume to start over"
        )
    seeded = state.incremental
    if seeded is not None and seeded.carry_from != request.carry_from:
        raise Untrusted(f"state.json: carry_from is {seeded.carry_from!r}, not {request.carry_from!r}")
    return _resumed(request, state, None, None, interrupted, notes)


def _resumed(
    request: Request,
    state: State,
    kept: Journaled | None,
    seeded_from: tuple[Plan, Record] | None,
    interrupted: Interrupted | None,
    notes: list[str],
) -> Start | None:
    """The start that keeps what the journal keeps (`kept`, or what of the interrupted build's is
    really there), or None when it cannot be trusted. `seeded_from`: the plan and record an
    incremental build just seeded the staging from (a resumed one has its record read again)."""
    if state.classes != request.classes:
        notes.append("the class folders changed since the interrupted build; starting over")
        return None
    if state.engine != request.engine:
        notes.append(f"the interrupted build ran on the {state.engine} engine; starting over")
        return None
    if state.tables != request.tables:
        notes.append("the metadata tables changed since the interrupted build; starting over")
        return None
    if kept is None:
        assert interrupted is not None
        kept = _still_there(interrupted) if state.engine == "local" else _groups_there(interrupted)
    seeded = state.incremental
    found = None
    if seeded is not None:
        found = seeded_from or _record_again(request, interrupted, notes)
        if found is None:
            return None
    written = kept.written()
    current = {item.relpath: item for item in request.items}
    # An incremental build's plan vouches for the rows of the files it did not preprocess (their
    # stamps are the record's; with --checksum a touched file of the same content is one of them).
    vouched = set() if found is None else set(current) - found[0].preprocess
    for (relpath, _), part in written.items():
        item = current.get(relpath)
        if relpath in vouched:
            continue
        if item is None or (item.size, item.mtime_ns) != (part.size, part.mtime_ns):
            notes.append(f"{relpath} changed or vanished since the interrupted build; starting over")
            return None
    start = Start("resume", state, kept)
    if seeded is not None and found is not None:
        plan, record = found
        done = {key: (part.rows, part.finished) for key, part in written.items()}
        notes.append(plan.changes.line())
        start = replace(
            start,
            only=frozenset(plan.preprocess),
            carry=tuple(incremental.remaining_carry(plan.carry, done)),
            carry_shard_rows=record.shard_rows,
            changes=plan.changes,
            skipped=plan.skipped,
            kept_samples=seeded.kept_samples + sum(run.rows for run in plan.carry),
        )
    resumed_samples = kept.samples - (seeded.kept_samples if seeded else 0)
    if resumed_samples < 0 and not storage.is_url(request.work_url):  # (the published dataset is intact)
        notes.append(
            "the interrupted build's copy of the last build's rows is not all there (a damaged disk?); starting over"
        )
        return None
    if resumed_samples < 0:  # an object store's dataset is changed in place: not ours to guess at
        raise Untrusted(f"state.json: kept_samples is more than the {kept.samples} rows the journal keeps")
    if resumed_samples:
        notes.append(f"resuming: {resumed_samples} samples kept from the interrupted build")
    return replace(
        start,
        resumed_shards=kept.done_shards - (seeded.kept_shards if seeded else 0),
        resumed_samples=resumed_samples,
        notes=tuple(notes),
    )


def _kept_work(interrupted: Interrupted) -> bool:
    """The interrupted build journaled samples of its own (not only the kept ones it was seeded
    with), or a journal that cannot be read (not ours to throw away unasked)."""
    seeded = interrupted.state.incremental
    return bool(interrupted.problem) or interrupted.journal.samples > (seeded.kept_samples if seeded else 0)


def _record_again(request: Request, interrupted: Interrupted | None, notes: list[str]) -> tuple[Plan, Record] | None:
    """A resumed incremental build's plan, made again from the record it builds on."""
    assert interrupted is not None
    if interrupted.record_problem:
        notes.append(f"the record of the last build is not used ({interrupted.record_problem}); starting over")
        return None
    if interrupted.record is None:
        notes.append("the record of the last build is gone; starting over")
        return None
    record = interrupted.record
    seeded = interrupted.state.incremental
    return _plan(request, record, seeded.damaged if seeded else ()), record


def _still_there(interrupted: Interrupted) -> Journaled:
    """What the interrupted build journaled and is really there: batches whose chunks lie within
    their shard files (the journal is written after its data is fsynced, so this only cuts what a
    damaged disk lost: from the first batch missing on, and its shard, finished or not, is open
    again), and a half-filled batch that still decodes."""
    if interrupted.problem:
        raise Untrusted(interrupted.problem)
    if not interrupted.arrays:
        return Journaled()
    journal = interrupted.journal
    batches, partial = journal.batches, journal.partial

    def present(batch: BatchLine) -> bool:
        if not batch.chunks and batch.shard < journal.done_shards:  # a whole shard an incremental build kept:
            return True  # the last build's file itself, checked against its hash as that build was planned
        for name in interrupted.arrays:
            if name not in batch.chunks:
                raise Untrusted(f"journal: batch {batch.batch} has no chunk of {name!r}")
            offset, nbytes = batch.chunks[name][:2]
            if interrupted.shard_sizes.get((name, batch.shard), -1) < offset + nbytes:
                return False
        return True

    done, hashes = journal.done_shards, journal.hashes
    cut = next((i for i, batch in enumerate(batches) if not present(batch)), None)
    if cut is not None:
        done = min(done, batches[cut].shard)
        batches, partial = batches[:cut], None
        hashes = {shard: found for shard, found in hashes.items() if shard < done}
    if not interrupted.partial_decodes:
        partial = None
    return Journaled(batches, partial, done, hashes=hashes)


def _groups_there(interrupted: Interrupted) -> Journaled:
    """What an interrupted Dask build journaled: the shards kept from the last build (finished
    shards) and the groups it finished whose shard or spill is really there."""
    if interrupted.problem:
        raise Untrusted(interrupted.problem)
    journal = interrupted.journal
    groups = tuple(line for line in journal.groups if line.group in interrupted.groups_present)
    return Journaled(journal.batches, None, journal.done_shards, groups, journal.hashes)


def _incremental_plan(request: Request, published: Published, notes: list[str]) -> tuple[Plan, Record] | None:
    """How to build on the complete dataset at OUTPUT, or None (and why, in one note) when
    everything must be built."""
    attrs = published.attrs
    if attrs is None:  # a first build (or a dataset of another format version): nothing to build on
        return None
    if not attrs.complete:
        notes.append("building everything: the dataset at OUTPUT was left incomplete")
        return None
    if request.force:
        notes.append("building everything (--force)")
        return None
    record, why_not = published.record, published.record_problem
    if record is not None and not why_not:
        try:
            check_fits(record, attrs, published.source_width)
        except Untrusted as exc:
            why_not = str(exc)
    if why_not:
        notes.append(f"building everything: the record {request.record_url} is not used: {why_not}")
        return None
    if record is None:
        notes.append("building everything: no record of which file each row of OUTPUT came from")
        return None
    why = differences({**record.spec, "source": record.source}, {**request.spec, "source": request.source})
    if record.classes != request.classes:
        why.append("the class folders changed")
    plan = _plan(request, record, published.damaged)
    longest = max((len(path.encode()) for path in plan.preprocess), default=0)
    if longest > record.source_width:
        why.append(f"a new path of {longest} bytes is longer than the source column's {record.source_width}")
    if why:
        notes.append("building everything: " + "; ".join(why))
        return None
    for shard, reason in sorted(published.damaged.items()):
        notes.append(f"shard {shard} of the last build is damaged ({reason}): its files are preprocessed again")
    return plan, record


def _plan(request: Request, record: Record, damaged: Collection[int] = ()) -> Plan:
    items = list(request.items)
    return incremental.plan(
        record, items, request.digests, request.checksum, request.keep_tail, damaged, request.row_hashes
    )


def _seed(request: Request, plan: Plan, record: Record, published: Published) -> tuple[Seed, State]:
    """The staging dataset an incremental build starts from: the previous dataset's kept shards
    renumbered 0..K-1 and journaled as finished, with their files' hashes (the open tail's batches
    with their chunks' places, read from its shard index), and the state naming the record it
    builds on."""
    lines: list[Line] = []
    tail = len(plan.done_shards)
    for batch in plan.kept_batches:
        position = batch.batch % record.shard_batches
        if batch.shard == tail:  # the open tail
            chunks = {name: spots[position] for name, spots in published.tail_chunks.items()}
            lines.append(replace(batch, chunks=chunks))
            continue
        lines.append(batch)
        if position == record.shard_batches - 1:
            lines.append(ShardDone(batch.shard, published.shard_hashes.get(plan.kept_shards[batch.shard], {})))
    damaged = tuple(sorted(published.damaged))
    seeded = Seeded(record.build_id, record.sha256, request.carry_from, tail, plan.kept_samples, damaged)
    state = State(request.spec, request.source, request.classes, request.engine, seeded, request.tables)
    carried = tuple(sorted({run.shard for run in plan.carry}))
    return Seed(tuple(plan.kept_shards), tail, carried, tuple(lines)), state


def differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """`key was A, now B` for each option that differs (the preprocessor's parts one by one)."""
    found = []
    for key in new:
        was, now = old.get(key), new.get(key)
        if was == now:
            continue
        if key == "preprocess" and isinstance(was, Mapping) and isinstance(now, Mapping):
            found.extend(_preprocess_differences(was, now))
        else:
            found.append(f"{key} was {was!r}, now {now!r}")
    return found


def _preprocess_differences(was: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    if was.get("name") != now.get("name"):
        return [f"the preprocessor was {was.get('name')}, now {now.get('name')}"]
    found = []
    if was.get("options") != now.get("options"):
        found.append(f"the preprocessor's options were {was.get('options')!r}, now {now.get('options')!r}")
    if was.get("code") != now.get("code"):
        name = str(now.get("name"))
        plugin = name.rpartition(":")[0] if ":" in name else ""  # its file or module
        versions = f"{was.get('code')} -> {now.get('code')}"  # a built-in's
        found.append(f"the preprocessor's code changed: {plugin or versions}")
    return found
