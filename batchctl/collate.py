"""Collate: the collator process assembles samples into batches and writes whole shards.

It is the only writer of the dataset's arrays, so every shard is written once, aligned and whole.
After each full shard it fsyncs the shard files and appends a line to the journal, which is what
a resumed build trusts. The first sample fixes the schema; samples that do not fit are rejected
with the field and both shapes.
"""

from __future__ import annotations

import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.queues import Queue, SimpleQueue
from typing import Any

import numpy as np
import zarr

from batchctl import format as fmt
from batchctl import staging, storage
from batchctl.preprocess import Sample
from batchctl.processes import init_child
from batchctl.ring import InRing, SampleRing
from batchctl.staging import BuildPaths
from batchctl.workers import TaskOutput, describe_error


@dataclass(frozen=True)
class CollatorConfig:
    paths: BuildPaths
    batch_size: int
    shard_batches: int | None
    compression: str
    labelled: bool
    source_bytes: int  # the width of the `source` array (the longest input path's UTF-8 bytes)
    resume_shards: int = 0


@dataclass(frozen=True)
class End:
    """Sent by the parent once all results are in; every task output is ahead of it in the pipe."""


@dataclass(frozen=True)
class ShardWritten:
    index: int
    rows: int
    nbytes: int


@dataclass(frozen=True)
class Rejected:
    source: str
    error: str
    samples: int


@dataclass(frozen=True)
class Finished:
    samples: int
    shards: int
    nbytes: int
    shard_batches: int
    schema: dict[str, dict[str, Any]]


@dataclass(frozen=True)
class Crashed:
    message: str


Event = ShardWritten | Rejected | Finished | Crashed


def check_schema(schema: fmt.Schema, sample: Sample) -> str | None:
    """Why `sample` does not fit `schema`, or None when it does."""
    taken = sorted(set(sample) & set(fmt.RESERVED_FIELDS))
    if taken:
        return f"field names {', '.join(taken)} are batchctl's own; rename them in the preprocessor"
    if set(sample) != set(schema):
        return f"fields {', '.join(sorted(sample))} differ from the dataset's {', '.join(sorted(schema))}"
    for name, value in sample.items():
        got, want = fmt.FieldSpec.of(value), schema[name]
        if got != want:
            return f"field {name!r} is {got.shape} {got.dtype}, the dataset's is {want.shape} {want.dtype}"
    return None


@dataclass
class _Shard:
    """Rows of the shard being filled, preallocated, plus the journal entries describing them."""

    columns: dict[str, np.ndarray]
    sources: list[str] = field(default_factory=list)
    entries: list[list[Any]] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return len(self.sources)


class Collator:
    def __init__(self, config: CollatorConfig, events: Queue[Event]) -> None:
        self.config = config
        self.events = events
        self.group = zarr.open_group(config.paths.staging_url, mode="r+", **config.paths.zarr_kwargs())
        self.arrays = fmt.open_arrays(self.group)
        self.schema: fmt.Schema | None = None
        self.layout: fmt.Layout | None = None
        self.shard_index = config.resume_shards
        self.nbytes = 0
        self.shard: _Shard | None = None
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchctl-write")
        self.writing: Future[None] | None = None
        self.written: _Shard | None = None  # the shard being written, or last written
        if self.arrays:
            self._adopt_existing()

    def _adopt_existing(self) -> None:
        """Resume: continue the arrays an interrupted run created."""
        self.schema = {
            name: fmt.FieldSpec(tuple(arr.shape[1:]), arr.dtype.name)
            for name, arr in self.arrays.items()
            if name not in fmt.RESERVED_FIELDS
        }
        shard_rows = self.arrays[fmt.SOURCE].shards[0]  # type: ignore[index]
        self.layout = fmt.Layout(self.config.batch_size, shard_rows // self.config.batch_size)
        self.shard = self._new_shard()

    def _start(self, rows: dict[str, np.ndarray]) -> None:
        self.schema = {name: fmt.FieldSpec.of(column[0]) for name, column in rows.items()}
        shard_batches = self.config.shard_batches or fmt.default_shard_batches(self.config.batch_size, self.schema)
        self.layout = fmt.Layout(self.config.batch_size, shard_batches)
        self.arrays = fmt.create_arrays(
            self.group,
            self.schema,
            self.layout,
            self.config.compression,
            self.config.labelled,
            self.config.source_bytes,
            rows,
        )
        self.shard = self._new_shard()

    def _new_shard(self, spare: _Shard | None = None) -> _Shard:
        """An empty shard; reusing a written shard's buffers saves faulting in fresh pages
        (~128 MiB a shard), which cost as much as copying the rows in."""
        if spare is not None:
            return _Shard(spare.columns)
        assert self.schema is not None and self.layout is not None
        rows = self.layout.shard_rows
        columns = {name: np.empty((rows, *spec.shape), spec.dtype) for name, spec in self.schema.items()}
        columns[fmt.SOURCE_INDEX] = np.empty(rows, np.int64)
        if self.config.labelled:
            columns[fmt.LABEL] = np.empty(rows, np.int64)
        return _Shard(columns)

    def add(self, output: TaskOutput) -> None:
        """Copy an output's rows into the shard being filled, writing each shard as it fills up."""
        first_row = {name: column[0] for name, column in output.columns.items()}
        reason = check_schema(self.schema or {n: fmt.FieldSpec.of(v) for n, v in first_row.items()}, first_row)
        if reason:  # (the worker checked that the rows of one output agree with each other)
            for task, rows in output.parts:
                self.events.put(Rejected(task.item.relpath, reason, rows))
            return
        if self.schema is None:
            self._start(output.columns)
        assert self.schema is not None and self.layout is not None and self.shard is not None
        counts = [rows for _, rows in output.parts]
        source_index = np.concatenate([np.arange(t.first + t.skip, t.first + t.skip + n) for t, n in output.parts])
        labels = np.repeat([task.item.label for task, _ in output.parts], counts)
        sources = [task.item.relpath for task, rows in output.parts for _ in range(rows)]
        parts = iter(output.parts)
        task, left = next(parts)  # the task whose rows come next, and how many of them are left
        done = 0
        while done < output.rows:
            shard, start = self.shard, self.shard.rows
            take = min(output.rows - done, self.layout.shard_rows - start)
            for name, column in output.columns.items():
                shard.columns[name][start : start + take] = column[done : done + take]
            shard.columns[fmt.SOURCE_INDEX][start : start + take] = source_index[done : done + take]
            if self.config.labelled:
                shard.columns[fmt.LABEL][start : start + take] = labels[done : done + take]
            shard.sources.extend(sources[done : done + take])
            done += take
            while take:  # journal what of each task this shard holds
                placed = min(left, take)
                take, left = take - placed, left - placed
                item = task.item
                shard.entries.append([item.relpath, placed, left == 0, item.size, item.mtime_ns, task.first])
                if left == 0 and (take or done < output.rows):  # more rows follow: the next task's
                    task, left = next(parts)
            if shard.rows == self.layout.shard_rows:
                self._write(journal=True)

    def _write(self, journal: bool) -> None:
        """Hand the full shard to the writer thread and go on filling a fresh one, so compression
        and disk writes overlap collation. At most one shard is being written: two buffers in all."""
        assert self.shard is not None
        self._wait_for_writer()
        spare, self.written = self.written, self.shard
        self.writing = self.writer.submit(self._store, self.shard_index, self.shard, journal)
        self.shard_index += 1
        self.shard = self._new_shard(spare)

    def _wait_for_writer(self) -> None:
        if self.writing is not None:
            self.writing.result()  # re-raises a failed write (a full disk, say) here
            self.writing = None

    def _store(self, index: int, shard: _Shard, journal: bool) -> None:
        assert self.layout is not None
        columns = {name: col[: shard.rows] for name, col in shard.columns.items()}
        columns[fmt.SOURCE] = np.array(shard.sources, dtype=object)  # encoded by the format
        fmt.write_shard(self.arrays, self.layout, index, columns)
        written = self._make_durable(index)
        self.nbytes += written
        if journal:
            self._journal(index, shard)
        self.events.put(ShardWritten(index, shard.rows, written))

    def _make_durable(self, index: int) -> int:
        """fsync shard `index`'s files (an object store's PUT is durable once it returns);
        its bytes on disk."""
        paths = self.config.paths
        keys = fmt.shard_keys(self.arrays, index)
        if paths.remote:
            root = storage.fs_path(paths.staging_url)
            return sum(int(paths.fs.size(f"{root}/{key}")) for key in keys)
        files = [path for key in keys if (path := paths.staging / key).is_file()]
        fmt.fsync_paths(files)
        return sum(path.stat().st_size for path in files)

    def _journal(self, index: int, shard: _Shard) -> None:
        staging.append_journal(self.config.paths, {"shard": index, "rows": shard.rows, "files": shard.entries})

    def finish(self) -> Finished:
        if self.shard is not None and self.shard.rows:
            self._write(journal=False)
        self._wait_for_writer()
        self.writer.shutdown()
        samples = self.arrays[fmt.SOURCE].shape[0] if self.arrays else 0
        schema = {name: spec.to_json() for name, spec in (self.schema or {}).items()}
        shard_batches = self.layout.shard_batches if self.layout else 0
        return Finished(samples, self.shard_index, self.nbytes, shard_batches, schema)


def run_collator(
    config: CollatorConfig, inbox: SimpleQueue[Any], events: Queue[Event], ring: SampleRing | None
) -> None:
    """Process entry point: collate until the parent's End and every task output it counts arrived."""
    init_child("batchctl-collator")
    try:
        collator = Collator(config, events)
        while not isinstance(message := inbox.get(), End):  # one worker's chunk
            if isinstance(message, InRing):
                assert ring is not None
                for output in ring.outputs(message):
                    collator.add(output)
                ring.release(message)
            else:
                for output in message:
                    collator.add(output)
        events.put(collator.finish())
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the build
        events.put(Crashed(f"the collator failed writing {config.paths.url}: {describe_error(exc)}"))
        events.close()
        events.join_thread()
        sys.exit(1)
