"""What one build leaves for the next, typed: the journal's lines, what a resume keeps of them
(`Journaled`, from `resolve`), and `state.json`. The record is `batchctl.store.record`.

A resumed or incremental build decides from these files what to keep, what to skip and which
rows to copy; a damaged or tampered one must never become a wrong dataset. Every line is checked
here, field by field (types, ranges, and the counts that tie lines together), as it is parsed;
`Untrusted` says which line and why, and the caller names the file and what to do. This module
is the only one that turns these types into JSON and back (docs/format.md, "Staging, journal and
lock"). The dataset's own attributes are checked with the same helpers (`metadata.DatasetAttrs.check`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from batchctl.errors import FormatError
from batchctl.records import PathKey
from batchctl.store.shardhash import is_shard_hash

MAX_COUNT = 2**63 - 1  # what an int64 holds: beyond any real count of rows, bytes or shards, or mtime in ns
ENGINES = ("local", "dask")

# (offset, nbytes) of a batch's chunk in its shard file; a ragged field's values, which span several
# chunks there, compressed to sizes of their own: (offset, nbytes, size of each chunk, ...)
Chunk = tuple[int, ...]


class Untrusted(FormatError):
    """A journal line, the record, the state or a dataset's attributes are not what batchctl writes."""


class FileRun(NamedTuple):
    """Consecutive rows of one file (or one part of it) in a batch; stored as the JSON list
    `[source, rows, finished, size, mtime_ns, first]`. `finished`: the part's last row is here;
    `first`: the file's sample number where the part starts; size and mtime_ns: the file's stamp
    when it was preprocessed."""

    source: str
    rows: int
    finished: bool
    size: int
    mtime_ns: int
    first: int

    @property
    def key(self) -> PathKey:
        return (self.source, self.first)


@dataclass(frozen=True)
class BatchLine:
    """A batch written durably: its number, its shard, its rows' files, and where each array's
    chunk lies in its shard file (empty in the record, and for the batches of shards kept whole)."""

    batch: int
    shard: int
    rows: int
    files: tuple[FileRun, ...]
    chunks: Mapping[str, Chunk] = field(default_factory=dict)


@dataclass(frozen=True)
class ShardDone:
    """Shard `shard` is finished: every batch of it is journaled and its index written.
    `hashes`: each array's shard file's hash (`shardhash.shard_hash`), where the writer hashed
    it whole as it wrote it (the dataset's digest is made from these; a shard without one is
    read back to hash it)."""

    shard: int
    hashes: Mapping[str, str] = field(default_factory=dict)  # the journal's key: "sha256" (its name before digest 3)


@dataclass(frozen=True)
class GroupLine:
    """--engine dask: group `group` is written, as its own shard (`full`) or as a spill file."""

    group: int
    full: bool
    rows: int
    files: tuple[FileRun, ...]


Line = BatchLine | ShardDone | GroupLine


def to_json(line: Line, chunks: bool = True) -> dict[str, Any]:
    """A line as it is written (`chunks=False`: as the record holds a batch)."""
    if isinstance(line, ShardDone):
        return {"shard_done": line.shard, **({"sha256": dict(line.hashes)} if line.hashes else {})}
    files = [list(run) for run in line.files]
    if isinstance(line, GroupLine):
        return {"group": line.group, "full": line.full, "rows": line.rows, "files": files}
    found: dict[str, Any] = {"batch": line.batch, "shard": line.shard, "rows": line.rows}
    if chunks:
        found["chunks"] = {name: list(place) for name, place in line.chunks.items()}
    found["files"] = files
    return found


def parse_line(value: Any, batch_size: int) -> Line:
    """Any line of a journal: a batch written, a shard finished, or a Dask group finished."""
    entry = mapping(value, "the line")
    if "shard_done" in entry:
        hashes = mapping(entry.get("sha256", {}), "sha256")
        for name, found in hashes.items():
            if not isinstance(found, str) or not is_shard_hash(found):
                raise Untrusted(f"the hash of {name!r}'s shard is {found!r}")
        return ShardDone(whole(entry["shard_done"], "shard_done"), hashes)
    if "group" in entry:
        group = whole(entry["group"], "group", -1)
        if not isinstance(entry.get("full"), bool):
            raise Untrusted(f"full is {entry.get('full')!r}")
        rows = whole(entry.get("rows"), "rows")
        return GroupLine(group, entry["full"], rows, parse_files(entry.get("files"), rows))
    return parse_batch(entry, batch_size, chunks=True)


def parse_lines(values: Iterable[Any], batch_size: int) -> list[Line]:
    """A journal's lines; the first that is not of batchctl's form raises `Untrusted` naming it."""
    lines = []
    for place, value in enumerate(values, 1):
        try:
            lines.append(parse_line(value, batch_size))
        except Untrusted as exc:
            raise Untrusted(f"journal line {place}: {exc}") from None
    return lines


def parse_batch(value: Any, batch_size: int, chunks: bool) -> BatchLine:
    """A batch line `{"batch", "shard", "rows", "files"}` (with `chunks`: `{array: [offset, nbytes]}`,
    a ragged field's compressed values `[offset, nbytes, size, ...]`: each chunk's size, adding up)."""
    batch = mapping(value, "the line")
    number = whole(batch.get("batch"), "batch")
    shard = whole(batch.get("shard"), "shard")
    rows = whole(batch.get("rows"), "rows", 1, batch_size)
    files = parse_files(batch.get("files"), rows)
    places: dict[str, Chunk] = {}
    if chunks:
        for name, place in mapping(batch.get("chunks"), "chunks").items():
            if not isinstance(place, list) or len(place) < 2:
                raise Untrusted(f"the place of chunk {name!r} is {place!r}, not [offset, nbytes]")
            found = tuple(whole(n, "a chunk's offset or size") for n in place)
            if len(found) > 2 and sum(found[2:]) != found[1]:
                raise Untrusted(f"the chunk sizes of {name!r} do not add up to its {found[1]} bytes")
            places[name] = found
    return BatchLine(number, shard, rows, files, places)


def parse_files(value: Any, rows: int) -> tuple[FileRun, ...]:
    """A line's `files`: runs `[source, rows, finished, size, mtime_ns, first]` adding up to `rows`."""
    runs = []
    for entry in sequence(value, "files"):
        if not isinstance(entry, list) or len(entry) != 6:
            raise Untrusted(f"a file entry is {entry!r}, not [source, rows, finished, size, mtime_ns, first]")
        if not isinstance(entry[2], bool):
            raise Untrusted(f"a file's finished flag is {entry[2]!r}")
        runs.append(
            FileRun(
                text(entry[0], "a file's source"),
                whole(entry[1], "a file's rows", 1),
                entry[2],
                whole(entry[3], "a file's size"),
                whole(entry[4], "a file's mtime_ns", -MAX_COUNT),
                whole(entry[5], "a file's first sample"),
            )
        )
    total = sum(run.rows for run in runs)
    if total != rows:
        raise Untrusted(f"its files hold {total} rows, not the batch's {rows}")
    return tuple(runs)


def check_sequence(batches: Sequence[BatchLine], batch_size: int, shard_batches: int | None) -> None:
    """Batches numbered 0..N-1 in order, full but the last; shard k holding batches
    k*shard_batches on (`None`: not known; each shard's batches then follow one another); and no
    row of a part of a file after the one marked its last."""
    finished: set[PathKey] = set()
    for number, batch in enumerate(batches):
        if batch.batch != number:
            raise Untrusted(f"batch {batch.batch} stands where batch {number} belongs")
        if batch.rows != batch_size and number != len(batches) - 1:
            raise Untrusted(f"batch {number} holds {batch.rows} rows, not {batch_size}, and is not the last")
        if shard_batches is not None and batch.shard != number // shard_batches:
            raise Untrusted(f"batch {number} is said to be in shard {batch.shard}, not {number // shard_batches}")
        if shard_batches is None and number and not 0 <= batch.shard - batches[number - 1].shard <= 1:
            raise Untrusted(f"batch {number} is in shard {batch.shard}, after shard {batches[number - 1].shard}")
        for run in batch.files:
            if run.key in finished:
                raise Untrusted(f"{run.source!r} (from sample {run.first}) has rows after its last one")
            if run.finished:
                finished.add(run.key)


@dataclass(frozen=True)
class Written:
    """What a journal holds of one part of a file: its rows, whether its last row is among them,
    and the file's stamp when it was preprocessed."""

    rows: int
    finished: bool
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class Journaled:
    """What an interrupted build left that a resumed one keeps: its full batches in order (the
    open shard's among them), the half-filled batch it stopped in (if any), how many shards it
    finished, and (--engine dask) the groups it finished."""

    batches: tuple[BatchLine, ...] = ()
    partial: BatchLine | None = None
    done_shards: int = 0
    groups: tuple[GroupLine, ...] = ()
    hashes: Mapping[int, Mapping[str, str]] = field(default_factory=dict)  # finished shard -> its files' hashes

    def lines(self) -> list[Line]:
        """The journal of just this, in order."""
        out: list[Line] = []
        for number, batch in enumerate(self.batches):
            out.append(batch)
            following = self.batches[number + 1].shard if number + 1 < len(self.batches) else None
            if batch.shard < self.done_shards and following != batch.shard:
                out.append(ShardDone(batch.shard, self.hashes.get(batch.shard, {})))
        return out + ([self.partial] if self.partial else []) + list(self.groups)

    @property
    def kept(self) -> tuple[BatchLine, ...]:
        """Every kept batch, the half-filled one last."""
        return self.batches + ((self.partial,) if self.partial else ())

    @property
    def open_batches(self) -> tuple[BatchLine, ...]:
        """The full batches of the shard left open (their chunks are in its file; its index is not)."""
        return tuple(batch for batch in self.batches if batch.shard >= self.done_shards)

    @property
    def samples(self) -> int:
        return sum(line.rows for line in self._lines_with_rows())

    def written(self) -> dict[PathKey, Written]:
        """Each part of a file with kept rows: how many, finished or not, and its stamp."""
        found: dict[PathKey, Written] = {}
        for line in self._lines_with_rows():
            for run in line.files:
                was = found.get(run.key)
                rows, done = (was.rows, was.finished) if was else (0, False)
                found[run.key] = Written(rows + run.rows, done or run.finished, run.size, run.mtime_ns)
        return found

    def _lines_with_rows(self) -> list[BatchLine | GroupLine]:
        return [*self.kept, *self.groups]


def resolve(lines: Sequence[Line], batch_size: int) -> Journaled:
    """The batches 0..K-1 in order, a later line for a batch replacing an earlier one (a resumed
    half-filled batch is written again once full), and the groups. Only the last batch can be
    short; anything out of order ends the journal there (`Untrusted` where what is kept breaks
    the form)."""
    batches: list[BatchLine] = []
    groups: list[GroupLine] = []
    hashes: dict[int, Mapping[str, str]] = {}
    done = 0
    for line in lines:
        if isinstance(line, ShardDone):
            if line.shard == done and line.hashes:
                hashes[done] = line.hashes
            done += line.shard == done
        elif isinstance(line, GroupLine):
            groups.append(line)
        elif batches and line.batch == batches[-1].batch and batches[-1].rows < batch_size:
            batches[-1] = line  # the half-filled batch, written again
        elif line.batch == len(batches) and (not batches or batches[-1].rows == batch_size):
            batches.append(line)
        else:
            break
    try:
        check_sequence(batches, batch_size, None)
    except Untrusted as exc:
        raise Untrusted(f"the journal's batches: {exc}") from None
    partial = None
    if batches and batches[-1].rows < batch_size and batches[-1].shard >= done:  # not a closed final shard
        partial = batches.pop()
    return Journaled(tuple(batches), partial, done, tuple(groups), hashes)


@dataclass(frozen=True)
class Seeded:
    """An incremental build's start: the last build it builds on (its record's id and hash),
    where the rows it carries are read, how much it kept whole, and the last build's shards it
    found damaged (their files preprocessed again: a resume plans the same)."""

    build_id: str
    record_sha256: str
    carry_from: str
    kept_shards: int
    kept_samples: int
    damaged: tuple[int, ...] = ()


@dataclass(frozen=True)
class State:
    """`state.json`: what an interrupted build started with (options, SOURCE, class folders,
    engine) and, for an incremental one, the last build it builds on."""

    spec: Mapping[str, Any]
    source: str
    classes: list[str] | None
    engine: str = "local"
    incremental: Seeded | None = None
    tables: str = ""  # the hash of the metadata tables' rows it started with ("": none)

    def to_json(self) -> dict[str, Any]:
        found = {"spec": self.spec, "source": self.source, "classes": self.classes, "engine": self.engine}
        if self.tables:
            found["tables"] = self.tables
        if self.incremental is not None:
            seeded = self.incremental
            incremental: dict[str, Any] = {
                "build_id": seeded.build_id,
                "record_sha256": seeded.record_sha256,
                "carry_from": seeded.carry_from,
                "kept_shards": seeded.kept_shards,
                "kept_samples": seeded.kept_samples,
            }
            if seeded.damaged:
                incremental["damaged_shards"] = list(seeded.damaged)
            found["incremental"] = incremental
        return found


def parse_state(value: Any) -> State:
    found = mapping(value, "the state")
    engine = found.get("engine", "local")
    if engine not in ENGINES:
        raise Untrusted(f"engine is {engine!r}")
    seeded = None
    if "incremental" in found:
        given = mapping(found["incremental"], "incremental")
        sha256 = given.get("record_sha256", "")
        if not isinstance(sha256, str):
            raise Untrusted(f"record_sha256 is {sha256!r}")
        seeded = Seeded(
            text(given.get("build_id"), "incremental build_id"),
            sha256,
            text(given.get("carry_from"), "carry_from"),
            whole(given.get("kept_shards"), "kept_shards"),
            whole(given.get("kept_samples"), "kept_samples"),
            tuple(whole(shard, "a damaged shard") for shard in _listed(given.get("damaged_shards", []))),
        )
    spec = mapping(found.get("spec"), "spec")
    tables = found.get("tables", "")
    if not isinstance(tables, str):
        raise Untrusted(f"tables is {tables!r}")
    classes = check_classes(found.get("classes"))
    return State(spec, text(found.get("source"), "source"), classes, engine, seeded, tables)


def _listed(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise Untrusted(f"damaged_shards is {value!r}, not a list")
    return value


def whole(value: Any, what: str, low: int = 0, high: int = MAX_COUNT) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise Untrusted(f"{what} is {value!r}, not a whole number from {low} to {high}")
    return value


def text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise Untrusted(f"{what} is {value!r}, not a non-empty string")
    return value


def mapping(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Untrusted(f"{what} is {type(value).__name__}, not an object")
    return value


def sequence(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise Untrusted(f"{what} is {type(value).__name__}, not a list")
    return value


def check_classes(value: Any, what: str = "classes") -> list[str] | None:
    if value is None:
        return None
    names = sequence(value, what)
    for name in names:
        text(name, what)
    return names
