"""The build report: what a run did, as returned by `build()` and written by `--report`."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

Status = Literal["complete", "up_to_date", "interrupted", "failed"]


@dataclass(frozen=True)
class FileError:
    source: str
    error: str
    retry: bool = False  # a transient failure (its worker died or timed out): the next run tries again


@dataclass(frozen=True)
class Changes:
    """An incremental build's changes to SOURCE since the last build: counts and relative paths."""

    added: dict[str, Any]
    changed: dict[str, Any]
    removed: dict[str, Any]
    retried: dict[str, Any] = field(default_factory=lambda: {"count": 0, "paths": []})  # a transient failure's files
    redone: dict[str, Any] = field(default_factory=lambda: {"count": 0, "paths": []})  # rows lost with a damaged shard

    @classmethod
    def of(cls, changes: Any) -> Changes:
        def listed(paths: list[str]) -> dict[str, Any]:
            return {"count": len(paths), "paths": list(paths)}

        return cls(
            listed(changes.added),
            listed(changes.changed),
            listed(changes.removed),
            listed(changes.retried),
            listed(changes.redone),
        )


@dataclass
class BuildReport:
    source: str
    output: str
    status: Status = "failed"
    samples: int = 0
    batches: int = 0
    shards: int = 0
    bytes: int = 0
    digest: str = ""  # of the dataset's content (`batchctl info` shows it; `verify` recomputes it)
    processed: int = 0
    resumed_shards: int = 0  # finished shards kept from an interrupted run
    resumed_samples: int = 0  # samples kept from an interrupted run (in those shards and after them)
    changes: Changes | None = None  # an incremental build: what changed in SOURCE since the last build
    kept_samples: int = 0  # an incremental build: samples of unchanged files kept from the last build
    carried_samples: int = 0  # of those, the ones read from rewritten shards and written again by this run
    errors: list[FileError] = field(default_factory=list)
    ignored: int = 0
    ignored_paths: list[str] = field(default_factory=list)  # the first 1000 of them
    elapsed_s: float = 0.0
    samples_per_s: float = 0.0
    # Where the time went (seconds): `before_build_s` (from the command's process start: the
    # interpreter, imports and the command line; the CLI only), `start_s` (from the build's start
    # until the first files could go to a worker: `discover_s` listing SOURCE and checking OUTPUT,
    # `plan_s` planning the start and making the tasks, `pool_s` starting the collator and the
    # workers), `preprocess_s` (until the last file's result), `finish_s` (until the collator
    # wrote its last batches and the last shard's index), `publish_s`; and, within these, the
    # collator's `fsync_s` (making shard files durable) and `writer_wait_s` (waiting for its
    # writer threads). `start_s` to `finish_s` where a local build preprocessed files; Dask: `publish_s`.
    timings: dict[str, float] = field(default_factory=dict)
    message: str = ""
    workers_seen: list[str] = field(default_factory=list)  # --engine dask: host:pid of each worker used
    in_place: bool = False  # the dataset at OUTPUT is being written in place (an object store has no rename)

    def time_before_build(self) -> None:
        """Note `before_build_s`: how long this process ran before the build (Linux: its start
        time in /proc; elsewhere nothing is noted)."""
        try:
            ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
            uptime = float(Path("/proc/uptime").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return
        age = uptime - ticks / os.sysconf("SC_CLK_TCK") - self.elapsed_s
        self.timings["before_build_s"] = round(max(age, 0.0), 3)

    def to_json(self) -> dict[str, Any]:
        """The report; an incremental build's `added`, `changed` and `removed` at the top level,
        and the files ignored (`{"count", "paths"}`, the first 1000 named)."""
        out = asdict(self)
        out["ignored"] = {"count": self.ignored, "paths": out.pop("ignored_paths")}  # as `added` and the others
        changes = out.pop("changes")
        out.update(changes or dict.fromkeys(("added", "changed", "removed", "retried", "redone")))
        return out

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")

    def summary(self) -> str:
        """The one-paragraph summary printed at the end of a build."""
        if self.status == "up_to_date":
            return f"{self.output} is up to date ({self.samples} samples); nothing to do."
        if self.status != "complete":
            verb = "Interrupted" if self.status == "interrupted" else "Failed"
            return (
                f"{verb} {self.output} after {self.elapsed_s:.1f} s: {self.processed} files preprocessed, "
                f"{len(self.errors)} skipped with errors; "
                + (
                    "OUTPUT is marked incomplete until a rerun finishes it."
                    if self.in_place
                    else "nothing at OUTPUT was changed."
                )
            )
        verb = "Built"
        text = (
            f"{verb} {self.output}: {count_of(self.samples, 'sample')} in {count_of(self.batches, 'batch')}, "
            f"{count_of(self.shards, 'shard')}, {size_text(self.bytes)}; "
            f"{count_of(self.processed, 'file')} preprocessed"
        )
        if self.changes is not None:
            retried, redone = self.changes.retried["count"], self.changes.redone["count"]
            text += (
                f" ({self.changes.added['count']} added, {self.changes.changed['count']} changed, "
                f"{self.changes.removed['count']} removed"
                + (f", {retried} retried" if retried else "")
                + (f", {redone} redone (damaged shards)" if redone else "")
                + f"; {count_of(self.kept_samples, 'sample')} kept"
                + (f", {self.carried_samples} of them carried into rewritten shards" if self.carried_samples else "")
                + ")"
            )
        if self.resumed_samples:
            text += f" ({count_of(self.resumed_samples, 'sample')} kept from an interrupted run)"
        text += f", {len(self.errors)} skipped with errors, {self.ignored} ignored; "
        # the samples this run wrote (preprocessed and carried) per second; none written: no rate to give
        rate = f", {self.samples_per_s:.1f} samples/s written" if self.processed or self.carried_samples else ""
        text += f"{self.elapsed_s:.1f} s{rate}."
        return text


def count_of(n: int, noun: str) -> str:
    """`1 batch`, `2 batches`."""
    plural = noun + ("es" if noun.endswith("ch") else "s")
    return f"{n} {noun if n == 1 else plural}"


def size_text(nbytes: int) -> str:
    """`812 B`, `50.1 KiB`, `1.2 GiB`."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{nbytes} B"
        value /= 1024
    return f"{value:.1f} TiB"
