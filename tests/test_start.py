"""Planning a build's start (`batchctl.plan.start.plan_start`), case by case, without files or
processes: every kind of interrupted work, published dataset, record and change."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest

from batchctl.errors import ResumeMismatchError
from batchctl.plan.start import Interrupted, Published, Request, Start, plan_resume, plan_start
from batchctl.records import WorkItem
from batchctl.store.journal import (
    BatchLine,
    FileRun,
    GroupLine,
    Journaled,
    Seeded,
    ShardDone,
    State,
    Untrusted,
    Written,
    resolve,
)
from batchctl.store.metadata import DatasetAttrs
from batchctl.store.record import Record, Skipped

SPEC = {"batch_size": 2, "shard_batches": 2, "preprocess": {"name": "image", "options": {}, "code": "1"}}
SOURCE = "/data/photos"
ARRAYS = ("image", "source", "source_index")


def items(count: int, mtime: int = 1000) -> list[WorkItem]:
    return [WorkItem(f"f{n:02d}.png", 0, 100 + n, mtime + n) for n in range(count)]


def request(files: Sequence[WorkItem], **given: object) -> Request:
    fields: dict[str, object] = {"spec": SPEC, "source": SOURCE, "classes": None, "items": list(files)}
    fields |= {"batch_size": 2, "carry_from": "/out/d.zarr", "work_url": "/out/.d.zarr.batchctl"}
    return Request(**(fields | given))  # type: ignore[arg-type]


def batches(
    files: Sequence[WorkItem], batch_size: int = 2, shard_batches: int = 2, chunks: bool = True
) -> list[BatchLine]:
    """One row per file, in order, cut into batches; each array's chunk `batch * 10` bytes on."""
    found = []
    for number, start in enumerate(range(0, len(files), batch_size)):
        runs = tuple(FileRun(f.relpath, 1, True, f.size, f.mtime_ns, 0) for f in files[start : start + batch_size])
        places = {name: ((number % shard_batches) * 10, 10) for name in ARRAYS} if chunks else {}
        found.append(BatchLine(number, number // shard_batches, len(runs), runs, places))
    return found


def journal_of(lines: Sequence[BatchLine], done: Sequence[int] = ()) -> Journaled:
    out: list[BatchLine | ShardDone] = []
    for line in lines:
        out.append(line)
        if line.shard in done and (line.batch + 1) % 2 == 0:
            out.append(ShardDone(line.shard))
    return resolve(out, 2)


def interrupted(journal: Journaled, state: State | None = None, **facts: object) -> Interrupted:
    shards = {b.shard for b in journal.kept}
    sizes = {(name, shard): 20 for name in ARRAYS for shard in shards}
    fields: dict[str, object] = {"arrays": ARRAYS, "shard_sizes": sizes, "partial_decodes": True}
    return Interrupted(state or State(SPEC, SOURCE, None), journal, **(fields | facts))  # type: ignore[arg-type]


def record(files: Sequence[WorkItem], **given: object) -> Record:
    fields: dict[str, object] = {
        "build_id": "b1",
        "spec": SPEC,
        "source": SOURCE,
        "classes": None,
        "batch_size": 2,
        "shard_batches": 2,
        "source_width": 32,
        "checksum": False,
        "batches": tuple(batches(files, chunks=False)),
        "sha256": "feed",
    }
    return Record(**(fields | given))  # type: ignore[arg-type]


def published(rec: Record | None, complete: bool = True, **given: object) -> Published:
    samples = sum(b.rows for b in rec.batches) if rec else 0
    attrs = DatasetAttrs(
        batch_size=2,
        shard_batches=2,
        fields={},
        classes=None,
        preprocess=SPEC["preprocess"],
        compression="auto",
        digest="b1",
        complete=complete,
        num_samples=samples,
        num_batches=-(-samples // 2),
    )
    return Published(attrs, rec, source_width=rec.source_width if rec else 32, **given)  # type: ignore[arg-type]


NOTHING = Published()  # no dataset at OUTPUT


def resumed(req: Request, facts: Interrupted) -> Start:
    """The start planned without the published facts (the builder reads them only when no resume
    is made): a resume, equal to what `plan_start` gives whatever is published."""
    start = plan_resume(req, facts)
    assert start is not None, "a resume was expected"
    assert plan_start(req, facts, published(record(list(req.items)))) == start
    return start


def test_a_first_build_starts_fresh_and_says_nothing() -> None:
    start = plan_start(request(items(5)), None, NOTHING)
    assert start.how == "fresh" and start.notes == () and start.kept == Journaled()
    assert start.state == State(SPEC, SOURCE, None, "local") and start.only is None and start.written() == {}


def test_an_interrupted_build_of_other_options_is_refused_naming_them() -> None:
    files = items(5)
    other = State({**SPEC, "batch_size": 4}, SOURCE, None)
    with pytest.raises(ResumeMismatchError, match="batch_size was 4, now 2.*--no-resume"):
        plan_resume(request(files), interrupted(journal_of(batches(files)), other))


def test_an_interrupted_build_of_other_options_that_kept_nothing_starts_over_saying_why() -> None:
    """Every file skipped, the preprocessor fixed: nothing to lose, so no --no-resume is needed."""
    files = items(5)
    other = State({**SPEC, "batch_size": 4}, SOURCE, None)
    assert plan_resume(request(files), interrupted(Journaled(), other)) is None
    start = plan_start(request(files), interrupted(Journaled(), other), NOTHING)
    assert start.how == "fresh"
    said = "the interrupted build kept no samples and used other options (batch_size was 4, now 2); starting over"
    assert start.notes == (said,)


def test_a_resume_keeps_every_journaled_batch_and_the_half_filled_one() -> None:
    files = items(5)
    journal = journal_of(batches(files))  # batches 0, 1 (shard 0), 2 (one row: the half-filled batch)
    start = resumed(request(files), interrupted(journal))
    assert start.how == "resume" and start.kept.batches == journal.batches and start.kept.partial == journal.partial
    assert start.resumed_samples == 5 and start.notes == ("resuming: 5 samples kept from the interrupted build",)
    assert start.written()[("f04.png", 0)] == Written(1, True, 104, 1004)


def test_a_batch_whose_chunks_a_damaged_disk_lost_ends_what_is_kept() -> None:
    files = items(6)
    journal = journal_of(batches(files))
    short = {(name, shard): 20 for name in ARRAYS for shard in (0, 1)} | {("image", 1): 5}
    start = resumed(request(files), interrupted(journal, shard_sizes=short))
    assert [b.batch for b in start.kept.batches] == [0, 1] and start.kept.partial is None
    assert set(start.written()) == {(f.relpath, 0) for f in files[:4]}


def test_a_half_filled_batch_that_does_not_decode_is_dropped_alone() -> None:
    files = items(5)
    start = resumed(request(files), interrupted(journal_of(batches(files)), partial_decodes=False))
    assert len(start.kept.batches) == 2 and start.kept.partial is None and start.resumed_samples == 4


def test_a_journal_not_of_batchctls_form_stops_the_build_naming_the_work_folder() -> None:
    files = items(4)
    no_chunk = dataclasses.replace(batches(files)[1], chunks={"image": (10, 10)})
    journal = resolve([batches(files)[0], no_chunk], 2)
    with pytest.raises(Untrusted, match=r"\.d\.zarr\.batchctl is not what batchctl wrote .*no chunk of 'source'"):
        resumed(request(files), interrupted(journal))
    bad = Interrupted(State(SPEC, SOURCE, None), problem="journal line 3: rows is 0")
    with pytest.raises(Untrusted, match="journal line 3: rows is 0.*--no-resume"):
        resumed(request(files), bad)


@pytest.mark.parametrize(
    ("state", "change", "note"),
    [
        (
            State(SPEC, SOURCE, ["cat", "dog"]),
            {},
            "the class folders changed since the interrupted build; starting over",
        ),
        (State(SPEC, SOURCE, None, "dask"), {}, "the interrupted build ran on the dask engine; starting over"),
        (
            State(SPEC, SOURCE, None),
            {"mtime": 7},
            "f00.png changed or vanished since the interrupted build; starting over",
        ),
    ],
)
def test_an_interrupted_build_that_cannot_be_trusted_is_started_over(state: State, change: dict, note: str) -> None:
    files = items(4)
    journal = journal_of(batches(files))
    now = items(4, mtime=change["mtime"]) if change else files
    start = plan_start(request(now), interrupted(journal, state), NOTHING)
    assert start.how == "fresh" and start.notes == (note,) and start.written() == {}


def test_no_resume_ignores_the_interrupted_work() -> None:
    files = items(4)
    start = plan_start(request(files, resume=False), interrupted(journal_of(batches(files))), NOTHING)
    assert start.how == "fresh"


def test_a_dask_resume_keeps_the_groups_whose_output_is_there() -> None:
    files = items(4)
    groups = [GroupLine(g, g == 0, 2, tuple(FileRun(f.relpath, 1, True, f.size, f.mtime_ns, 0) for f in pair))
              for g, pair in enumerate([files[:2], files[2:]])]  # fmt: skip
    state = State(SPEC, SOURCE, None, "dask")
    facts = Interrupted(state, resolve(groups, 2), arrays=ARRAYS, groups_present=frozenset({1}))
    start = resumed(request(files, engine="dask"), facts)
    assert start.kept.groups == (groups[1],) and set(start.written()) == {("f02.png", 0), ("f03.png", 0)}


def test_a_change_builds_incrementally_keeping_the_untouched_shards_whole() -> None:
    files = items(8)  # shards 0..1 of 4 rows each
    now = [*files[:5], dataclasses.replace(files[5], mtime_ns=9), *files[6:], WorkItem("new.png", 0, 1, 1)]
    start = plan_start(request(now), None, published(record(files)))
    assert start.how == "incremental" and start.seed is not None
    assert start.seed.kept_shards == (0,) and start.seed.whole == 1 and start.seed.carried_shards == (1,)
    assert start.only == {"f05.png", "new.png"}
    assert [(run.item.relpath, run.rows) for run in start.carry] == [("f04.png", 1), ("f06.png", 1), ("f07.png", 1)]
    assert start.kept_samples == 4 + 3 and start.resumed_samples == 0
    assert start.state.incremental == Seeded("b1", "feed", "/out/d.zarr", 1, 4)
    assert start.notes == ("1 added, 1 changed, 0 removed since the last build",)
    assert [type(line).__name__ for line in start.seed.lines] == ["BatchLine", "BatchLine", "ShardDone"]


def test_the_short_last_shard_is_kept_open_with_its_chunks_places() -> None:
    files = items(7)  # shard 1: batches 2 (2 rows) and 3 (1 row)
    tail = {name: ((0, 10), (10, 5)) for name in ARRAYS}
    start = plan_start(request([*files, WorkItem("new.png", 0, 1, 1)]), None,
                       published(record(files), tail_chunks=tail))  # fmt: skip
    assert start.seed is not None and start.seed.kept_shards == (0, 1) and start.seed.whole == 1
    assert start.carry == () and start.kept.partial is not None and start.kept.partial.chunks["image"] == (10, 5)
    assert [b.chunks.get("image") for b in start.kept.batches] == [None, None, (0, 10)]
    without = plan_start(request([*files, WorkItem("new.png", 0, 1, 1)], keep_tail=False), None,
                         published(record(files)))  # fmt: skip
    assert without.seed is not None and without.seed.kept_shards == (0,) and len(without.carry) == 3


def test_an_unchanged_file_the_last_build_skipped_is_reported_again_not_retried() -> None:
    files = items(5)
    gone = Skipped(files[4].size, files[4].mtime_ns, "truncated", False)
    rec = record(files[:4], skipped={"f04.png": gone})
    start = plan_start(request([*files, WorkItem("new.png", 0, 1, 1)]), None, published(rec))
    assert start.skipped == {"f04.png": gone} and start.only == {"new.png"}


EVERYTHING = "building everything: "


@pytest.mark.parametrize(
    ("facts", "ask", "note"),
    [
        (published(record(items(4)), complete=False), {}, EVERYTHING + "the dataset at OUTPUT was left incomplete"),
        (published(record(items(4))), {"force": True}, "building everything (--force)"),
        (published(None), {}, EVERYTHING + "no record of which file each row of OUTPUT came from"),
        (
            published(None, record_problem="it is another build's"),
            {},
            EVERYTHING + "the record  is not used: it is another",
        ),
        (published(record(items(4), batch_size=4)), {}, EVERYTHING + "the record  is not used: it does not describe"),
        (published(record(items(4), spec={**SPEC, "batch_size": 4})), {}, EVERYTHING + "batch_size was 4, now 2"),
        (published(record(items(4), classes=["a"])), {}, EVERYTHING + "the class folders changed"),
        (
            published(record(items(4), source_width=4)),
            {},
            EVERYTHING + "a new path of 7 bytes is longer than the source",
        ),
    ],
)
def test_what_cannot_be_built_on_is_built_whole_saying_why(facts: Published, ask: dict, note: str) -> None:
    start = plan_start(request([*items(4), WorkItem("new.png", 0, 1, 1)], **ask), None, facts)
    assert start.how == "fresh" and len(start.notes) == 1 and start.notes[0].startswith(note)


def test_a_resumed_incremental_build_carries_only_what_it_had_not_written() -> None:
    files = items(8)
    now = [*files[:5], dataclasses.replace(files[5], mtime_ns=9), *files[6:]]
    first = plan_start(request(now), None, published(record(files)))
    carried = first.carry[0]  # f04.png: written into batch 2 before the kill
    run = FileRun(carried.item.relpath, 1, True, carried.item.size, carried.item.mtime_ns, 0)
    lines = [*first.kept.lines(), BatchLine(2, 1, 1, (run,), {name: (0, 10) for name in ARRAYS})]
    facts = interrupted(resolve(lines, 2), first.state, record=record(files))
    start = resumed(request(now), facts)
    assert start.how == "resume" and start.kept.partial is not None
    assert [c.item.relpath for c in start.carry] == ["f06.png", "f07.png"] and start.resumed_samples == 1
    gone = plan_start(request(now), dataclasses.replace(facts, record=None), published(record(files)))
    assert gone.notes[0] == "the record of the last build is gone; starting over" and gone.how == "incremental"


def test_with_checksum_a_touched_file_of_the_same_content_keeps_its_rows() -> None:
    files = items(4)
    digests = {f.relpath: f"sha-{f.relpath}" for f in files}
    touched = [dataclasses.replace(f, mtime_ns=f.mtime_ns + 5) for f in files]
    rec = record(files, checksum=True, digests=digests)
    start = plan_start(request([*touched, WorkItem("new.png", 0, 1, 1)], checksum=True, digests=digests), None,
                       published(rec))  # fmt: skip
    assert start.how == "incremental" and start.only == {"new.png"} and start.kept_samples == 4


def test_fewer_rows_in_the_journal_than_the_incremental_build_kept_start_it_over() -> None:
    """Rows it copied from the last build are gone from the work folder (a damaged disk): the
    published dataset is intact, so the incremental build is made again from it; on an object
    store, where the dataset is changed in place, the work is refused."""
    files = items(4)
    state = State(SPEC, SOURCE, None, incremental=Seeded("b1", "feed", "/out/d.zarr", 0, 99))
    facts = interrupted(journal_of(batches(files)), state, record=record(files))
    assert plan_resume(request(files), facts) is None
    start = plan_start(request(files), facts, published(record(files)))
    assert start.how != "resume" and any("starting over" in note for note in start.notes), start.notes
    carry = "s3://b/.d.zarr.batchctl/previous.zarr"
    state = State(SPEC, SOURCE, None, incremental=Seeded("b1", "feed", carry, 0, 99))
    facts = interrupted(journal_of(batches(files)), state, record=record(files))
    with pytest.raises(Untrusted, match="kept_samples is more than the 4 rows"):
        plan_resume(request(files, carry_from=carry, work_url="s3://b/.d.zarr.batchctl"), facts)


def test_the_plan_is_a_pure_function_of_its_facts() -> None:
    """The same request and facts give equal starts, however often planned (the builder plans
    twice when kept shards are damaged); a resume is planned without the published facts, and
    `plan_resume` says when there is none to make."""
    files = items(4)
    facts = interrupted(journal_of(batches(files)[:1]))
    first, again = resumed(request(files), facts), resumed(request(files), facts)
    assert first == again and first.how == "resume"
    assert plan_start(request(items(2)), None, NOTHING) == plan_start(request(items(2)), None, NOTHING)
    assert plan_resume(request(items(2)), None) is None
    assert plan_resume(request(files, resume=False), facts) is None
    assert plan_resume(request(files, engine="dask"), facts) is None  # another engine's work: started over
