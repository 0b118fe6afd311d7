"""What a build hands the process that writes its shards (where to write, where an interrupted
run stopped, and the rows an incremental build carries over), and what an engine hands back.
Plain data, no zarr: the parent of a build never needs the Zarr stack to describe the work."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batchctl.records import CarryRun, Finished
from batchctl.run.staging import Workdir
from batchctl.store.journal import Journaled


@dataclass(frozen=True)
class CollatorConfig:
    work: Workdir  # the build's work folder (its one owner: the builder made it)
    batch_size: int
    shard_batches: int | None
    compression: str
    labelled: bool
    source_bytes: int  # the width of the `source` array (the longest input path's UTF-8 bytes)
    resume: Journaled = Journaled()  # where an interrupted build stopped
    carry: Carry | None = None


@dataclass(frozen=True)
class Carry:
    """An incremental build's rows of unchanged files, copied from the previous dataset at `url`
    (decoded there, encoded again here: they move into new batches), before any new sample."""

    url: str
    storage_options: Mapping[str, Any]
    shard_rows: int
    runs: list[CarryRun]


@dataclass(frozen=True)
class Outcome:
    """What an engine made, as it says (the parent reads nothing back): its `Finished`, and the
    journal of the whole staging dataset resolved (what it kept and what it wrote: every
    batch's rows and files, for the record; the shard files' hashes its writers took)."""

    finished: Finished
    journal: Journaled
