"""The form of what one build leaves for the next: journal lines, the record and the state.

A resumed or incremental build decides from these files what to keep, what to skip and which
rows to copy; a damaged or tampered one must never become a wrong dataset. Every line is checked
here, field by field (types, ranges, and the counts that tie lines together), before a build uses
it; `Untrusted` says which line and why, and the caller names the file and what to do. The
dataset's own attributes are checked with the same helpers (`metadata.DatasetAttrs.check`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from batchctl.errors import FormatError

MAX_COUNT = 2**63 - 1  # what an int64 holds: beyond any real count of rows, bytes or shards, or mtime in ns
ENGINES = ("local", "dask")


class Untrusted(FormatError):
    """A journal line, the record, the state or a dataset's attributes are not what batchctl writes."""


def whole(value: Any, what: str, low: int = 0, high: int = MAX_COUNT) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise Untrusted(f"{what} is {value!r}, not a whole number from {low} to {high}")
    return value


def _str(value: Any, what: str) -> str:
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
        _str(name, what)
    return names


def check_files(value: Any, rows: int) -> list[list[Any]]:
    """A batch's `files`: runs `[source, rows, finished, size, mtime_ns, first]` adding up to `rows`."""
    entries = sequence(value, "files")
    total = 0
    for entry in entries:
        if not isinstance(entry, list) or len(entry) != 6:
            raise Untrusted(f"a file entry is {entry!r}, not [source, rows, finished, size, mtime_ns, first]")
        _str(entry[0], "a file's source")
        total += whole(entry[1], "a file's rows", 1)
        if not isinstance(entry[2], bool):
            raise Untrusted(f"a file's finished flag is {entry[2]!r}")
        whole(entry[3], "a file's size")
        whole(entry[4], "a file's mtime_ns", -MAX_COUNT)
        whole(entry[5], "a file's first sample")
    if total != rows:
        raise Untrusted(f"its files hold {total} rows, not the batch's {rows}")
    return entries


def check_batch(line: Any, batch_size: int, chunks: bool) -> dict[str, Any]:
    """A batch line `{"batch", "shard", "rows", "files"}` (with `chunks`: `{array: [offset, nbytes]}`)."""
    batch = mapping(line, "the line")
    whole(batch.get("batch"), "batch")
    whole(batch.get("shard"), "shard")
    rows = whole(batch.get("rows"), "rows", 1, batch_size)
    check_files(batch.get("files"), rows)
    if chunks:
        for name, place in mapping(batch.get("chunks"), "chunks").items():
            if not isinstance(place, list) or len(place) != 2:
                raise Untrusted(f"the place of chunk {name!r} is {place!r}, not [offset, nbytes]")
            whole(place[0], "a chunk's offset")
            whole(place[1], "a chunk's size")
    return batch


def check_journal_line(line: Any, batch_size: int) -> dict[str, Any]:
    """Any line of a journal: a batch written, a shard finished, or a Dask group finished."""
    entry = mapping(line, "the line")
    if "shard_done" in entry:
        whole(entry["shard_done"], "shard_done")
        return entry
    if "group" in entry:
        whole(entry["group"], "group", -1)
        if not isinstance(entry.get("full"), bool):
            raise Untrusted(f"full is {entry.get('full')!r}")
        rows = whole(entry.get("rows"), "rows")
        check_files(entry.get("files"), rows)
        return entry
    return check_batch(entry, batch_size, chunks=True)


def check_sequence(batches: Sequence[Mapping[str, Any]], batch_size: int, shard_batches: int | None) -> None:
    """Batches numbered 0..N-1 in order, full but the last; shard k holding batches
    k*shard_batches on (`None`: not known; each shard's batches then follow one another); and no
    row of a part of a file after the one marked its last."""
    finished: set[tuple[str, int]] = set()
    for number, batch in enumerate(batches):
        if batch["batch"] != number:
            raise Untrusted(f"batch {batch['batch']} stands where batch {number} belongs")
        if batch["rows"] != batch_size and number != len(batches) - 1:
            raise Untrusted(f"batch {number} holds {batch['rows']} rows, not {batch_size}, and is not the last")
        if shard_batches is not None and batch["shard"] != number // shard_batches:
            raise Untrusted(f"batch {number} is said to be in shard {batch['shard']}, not {number // shard_batches}")
        if shard_batches is None and number and not 0 <= batch["shard"] - batches[number - 1]["shard"] <= 1:
            raise Untrusted(f"batch {number} is in shard {batch['shard']}, after shard {batches[number - 1]['shard']}")
        for relpath, _, done, _, _, first in batch["files"]:
            if (relpath, first) in finished:
                raise Untrusted(f"{relpath!r} (from sample {first}) has rows after its last one")
            if done:
                finished.add((relpath, first))


def check_record_header(header: Any) -> dict[str, Any]:
    """The record's first line (docs/format.md, "The record")."""
    head = mapping(header, "the header")
    _str(head.get("build_id"), "build_id")
    mapping(head.get("spec"), "spec")
    _str(head.get("source"), "source")
    check_classes(head.get("classes"))
    whole(head.get("batch_size"), "batch_size", 1)
    whole(head.get("shard_batches"), "shard_batches", 1)
    whole(head.get("source_width"), "source_width", 1)
    if not isinstance(head.get("checksum"), bool):
        raise Untrusted(f"checksum is {head.get('checksum')!r}")
    for relpath, entry in mapping(head.get("skipped"), "skipped").items():
        if not isinstance(entry, list) or len(entry) != 4:
            raise Untrusted(f"the skipped entry of {relpath!r} is {entry!r}, not [size, mtime_ns, reason, retry]")
        whole(entry[0], "a skipped file's size")
        whole(entry[1], "a skipped file's mtime_ns", -MAX_COUNT)
        if not isinstance(entry[2], str) or not isinstance(entry[3], bool):
            raise Untrusted(f"the skipped entry of {relpath!r} is {entry!r}")
    for relpath, digest in mapping(head.get("digests"), "digests").items():
        _str(digest, f"the digest of {relpath!r}")
    return head


def check_state(state: Any) -> dict[str, Any]:
    """`state.json`: the options and SOURCE an interrupted build started with (and, for an
    incremental one, the last build it builds on)."""
    found = mapping(state, "the state")
    mapping(found.get("spec"), "spec")
    _str(found.get("source"), "source")
    check_classes(found.get("classes"))
    if found.get("engine", "local") not in ENGINES:
        raise Untrusted(f"engine is {found.get('engine')!r}")
    if "incremental" in found:
        seeded = mapping(found["incremental"], "incremental")
        _str(seeded.get("build_id"), "incremental build_id")
        _str(seeded.get("carry_from"), "carry_from")
        whole(seeded.get("kept_shards"), "kept_shards")
        whole(seeded.get("kept_samples"), "kept_samples")
        if not isinstance(seeded.get("record_sha256", ""), str):
            raise Untrusted(f"record_sha256 is {seeded.get('record_sha256')!r}")
    return found
