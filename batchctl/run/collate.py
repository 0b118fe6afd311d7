"""Collate: the collator process assembles samples into batches and streams them into shards.

It is the only writer of the dataset's arrays. Chunks of samples are placed in the dispatch
order, whatever order the workers finish in (`Placement`, `batchctl.run.reorder`): the main
thread decides where each row goes and keeps the journal's account, a copy thread moves the rows'
bytes into their batch (a 150 KB photo's copy was a third of the main thread's work, the thread
that caps how many workers a build can use). Each batch, the moment it is full and copied, is
encoded and appended to its shard (one chunk per array,
`batchctl.store.shards`); each chunk is hashed by the writer thread that encodes it, and a
shard's hash combines its chunks' (`digest.shard_hash`), so no one thread hashes every byte. The
shard's index is written when its last batch is in. About every second the shard files are
fsynced (in the writer threads) and then the batches written before are journaled, so a build
killed outright loses at most the last second or two. Stopped gracefully (the parent's `Stop`),
it writes and journals its half-filled batch too, and a resumed build picks that batch up again.
The first sample in dispatch order fixes the schema; samples that do not fit are rejected with
the field and both shapes.
"""

from __future__ import annotations

import os
import select
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from itertools import groupby
from multiprocessing.connection import Connection
from multiprocessing.queues import Queue, SimpleQueue
from typing import Any

import numpy as np

from batchctl.records import (
    BatchWritten,
    CarryRun,
    Crashed,
    End,
    Event,
    Finished,
    JournalLines,
    Lost,
    PathKey,
    Rejected,
    SentTask,
    Stopped,
    Task,
    TaskOutput,
    describe_error,
)
from batchctl.run.mpinternals import queue_reader
from batchctl.run.processes import init_child
from batchctl.run.reorder import Reorder
from batchctl.run.ring import InRing, SampleRing, Sent
from batchctl.run.rows import check_schema, columns_schema, provenance, runs_of
from batchctl.run.writeplan import Carry, CollatorConfig
from batchctl.store import codec, format as fmt, metadata, ragged, shards, storage
from batchctl.store.journal import BatchLine, Chunk, FileRun, Line, ShardDone
from batchctl.store.shardhash import chunk_digest

SYNC_S = 1.0  # batches are journaled (their shard files fsynced first) at most this long after being written
# Threads that encode and write batches (zstd, blosc, crc32c and pwritev release the GIL). The
# kernel's copy into the page cache alone cost up to ~1/6 of a worker's CPU per photo here, so it
# is spread thin: with 8 threads no one thread exceeds ~1/25 (benchmarks/run.py measures it).
WRITE_THREADS = 8
BATCHES_IN_FLIGHT = 6  # batch buffers being encoded or written, at most (memory: a few batches)
# Set only by benchmarks/order.py, to measure what placing rows in dispatch order costs against
# placing them as they arrive (what batchctl did before 2026-12-06): the dataset then depends on
# which worker was quicker.
WRITE_SLICE = 2**20  # a big chunk is written in slices of this many bytes, by all writer threads at once


@dataclass
class _InFlight:
    """A full batch handed to the writer threads: encoded, then placed in its shard (in batch
    order) and written; journaled once it and every batch before it are written and fsynced."""

    line: BatchLine  # its journal line, without its chunks' places until it is placed
    encoding: Future[dict[str, list[tuple[list[Any], bytes]]]]  # each array's chunks: their pieces and hash
    buffers: dict[str, np.ndarray]
    writing: list[Future[None]] | None = None
    chunks: dict[str, Chunk] = field(default_factory=dict)  # filled in when placed


@dataclass
class _Batch:
    """The rows of the batch being filled, plus the journal entries describing them, and the
    copies of its rows still to be made (by the copy thread: `Collator.add`)."""

    columns: dict[str, np.ndarray]
    sources: list[str] = field(default_factory=list)
    entries: list[FileRun] = field(default_factory=list)
    copies: list[Future[None]] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return len(self.sources)


class Collator:
    def __init__(self, config: CollatorConfig, events: Queue[Event]) -> None:
        self.config = config
        self.events = events
        self.work = config.work
        self.paths = config.work.paths
        self.files = self.paths.staging_files
        self.local_root = None if self.paths.remote else self.paths.staging
        self.arrays = self.files.arrays()
        self.schema: metadata.Schema | None = None
        self.layout: metadata.Layout | None = None
        self.encoders: dict[str, codec.ChunkEncoder] = {}
        self.ragged: dict[str, ragged.ValuesEncoder] = {}  # by field: the encoder of its values
        self.batch: _Batch | None = None
        self.next_batch = len(config.resume.batches)  # the number of the batch being filled
        self.samples = sum(batch.rows for batch in config.resume.batches)
        self.open: dict[str, shards.OpenShard] = {}
        self.open_index = -1  # the shard being filled, or -1
        self.unjournaled: list[Line] = []
        # the open shard files being fsynced in the writer threads, and the lines their fsyncs make durable
        self.syncing: tuple[list[Future[float]], list[Line]] | None = None
        self.in_flight: deque[_InFlight] = deque()
        self.spare: list[dict[str, np.ndarray]] = []  # batch buffers free to be filled again
        self.threads = ThreadPoolExecutor(WRITE_THREADS, thread_name_prefix="batchctl-write")
        # copies each output's rows into its batch, in the order given; then frees what they were
        # copied from (`hand_over_copies`): the main thread only places rows, one thread moves their bytes
        self.copier = ThreadPoolExecutor(1, thread_name_prefix="batchctl-copy")
        self.moves: list[tuple[np.ndarray, np.ndarray]] = []  # (into, rows) placed, not yet handed to it
        self.last_sync = time.monotonic()
        self.fsync_s = 0.0  # time in fsync, and waiting for the writer threads (the build's report)
        self.wait_s = 0.0
        if self.arrays:
            self._adopt_existing()

    def _adopt_existing(self) -> None:
        """Resume: continue the arrays an interrupted run created, in its open shard, from the
        half-filled batch it left (read back from that shard, whose file is cut before it)."""
        self.schema = metadata.schema_of_arrays(self.arrays)
        shard_rows = self.arrays[metadata.SOURCE].grid[0]
        self._layout(metadata.Layout(self.config.batch_size, shard_rows // self.config.batch_size))
        resume = self.config.resume
        if resume.partial is not None:
            self._reload(resume.partial)  # before its shard file is cut short
        unfinished = resume.open_batches
        if unfinished:
            chunks = {name: [batch.chunks[name] for batch in unfinished] for name in self.arrays}
            self._open_shards(unfinished[0].shard, chunks)
            if len(unfinished) == self._shard_batches():  # full, but its index was not written
                self._close_shards()

    def _reload(self, partial: BatchLine) -> None:
        assert self.local_root is not None and self.batch is not None
        stored = {
            name: shards.read_chunk(arr, partial.shard, self.local_root, partial.chunks[name])
            for name, arr in self.arrays.items()
        }
        for field_name, encoder in self.ragged.items():
            place = partial.chunks[metadata.values_array(field_name)]
            values = encoder.decode(stored.pop(metadata.values_array(field_name)), place, encoder.name)
            offsets = self.encoders[metadata.offsets_array(field_name)].decode(
                stored.pop(metadata.offsets_array(field_name))
            )
            self.batch.columns[field_name][: partial.rows] = ragged.rows_of(offsets[: partial.rows], values)
        for name, data in stored.items():
            rows = self.encoders[name].decode(data)[: partial.rows]
            if name == metadata.SOURCE:
                self.batch.sources = fmt.decode_sources(rows).tolist()
            else:
                self.batch.columns[name][: len(rows)] = rows
        self.batch.entries = list(partial.files)

    def _layout(self, layout: metadata.Layout) -> None:
        self.layout = layout
        self.encoders = {
            name: codec.ChunkEncoder.for_array(arr) for name, arr in self.arrays.items() if not ragged.is_values(arr)
        }
        self.ragged = {
            metadata.ragged_part(name)[0]: ragged.ValuesEncoder(arr)
            for name, arr in self.arrays.items()
            if ragged.is_values(arr)
        }
        self.batch = self._new_batch()

    def _shard_batches(self) -> int:
        assert self.layout is not None
        return self.layout.shard_batches

    def _start(self, rows: dict[str, np.ndarray]) -> None:
        self.schema = columns_schema(rows)
        ragged_bytes = sum(rows[name][0].nbytes for name, spec in self.schema.items() if spec.ragged)
        shard_batches = self.config.shard_batches or metadata.default_shard_batches(
            self.config.batch_size, self.schema, ragged_bytes
        )
        layout = metadata.Layout(self.config.batch_size, shard_batches)
        self.arrays = fmt.create_arrays(
            self.files,
            self.schema,
            layout,
            self.config.compression,
            self.config.labelled,
            self.config.source_bytes,
            rows,
        )
        self._layout(layout)

    def _new_batch(self) -> _Batch:
        """An empty batch: buffers a written batch gave back, else fresh ones (at most
        BATCHES_IN_FLIGHT + 1 sets in all: past that, wait for the oldest batch in flight)."""
        while not self.spare and len(self.in_flight) >= BATCHES_IN_FLIGHT:
            self._wait_for_writers()
        if self.spare:
            return _Batch(self.spare.pop())
        assert self.schema is not None and self.layout is not None
        rows = self.layout.batch_size
        columns = {
            name: np.empty(rows, object) if spec.ragged else np.empty((rows, *spec.shape), spec.dtype)
            for name, spec in self.schema.items()
        }
        columns[metadata.SOURCE_INDEX] = np.empty(rows, np.int64)
        if self.config.labelled:
            columns[metadata.LABEL] = np.empty(rows, np.int64)
        return _Batch(columns)

    def add(self, output: TaskOutput) -> None:
        """Copy an output's rows into the batch being filled, writing each batch as it fills up."""
        found = columns_schema(output.columns)
        reason = check_schema(self.schema or found, found)
        if reason:  # (the worker checked that the rows of one output agree with each other)
            for task, rows in output.parts:
                self.events.put(Rejected(task[1], reason, rows))
            return
        if self.schema is None:
            self._start(output.columns)
        assert self.layout is not None and self.batch is not None
        source_index, labels, sources = provenance(runs_of(output))
        parts = iter(output.parts)
        (_, relpath, _, size, mtime_ns, part, *_), left = next(parts)  # the task whose rows come next, and how many
        done = 0
        while done < output.rows:
            batch, start = self.batch, self.batch.rows
            take = min(output.rows - done, self.layout.batch_size - start)
            for name, column in output.columns.items():
                into, taken = batch.columns[name][start : start + take], column[done : done + take]
                if column.dtype.hasobject:  # a ragged field's rows (arrays): cut into values on this thread
                    into[...] = taken
                else:
                    self.moves.append((into, taken))
            batch.columns[metadata.SOURCE_INDEX][start : start + take] = source_index[done : done + take]
            if self.config.labelled:
                batch.columns[metadata.LABEL][start : start + take] = labels[done : done + take]
            batch.sources.extend(sources[done : done + take])
            done += take
            while take:  # journal what of each task this batch holds
                placed = min(left, take)
                take, left = take - placed, left - placed
                _append_run(batch.entries, FileRun(relpath, placed, left == 0, size, mtime_ns, part[0] if part else 0))
                if left == 0 and (take or done < output.rows):  # more rows follow: the next task's
                    (_, relpath, _, size, mtime_ns, part, *_), left = next(parts)
            if batch.rows == self.layout.batch_size:
                self._write_batch()

    def hand_over_copies(self, then: Callable[[], None] | None = None) -> None:
        """Give the copy thread the rows placed so far, and `then` to run once they are copied
        (a ring slot freed after its rows), as one job the batch being filled waits for before
        it is encoded: one job for a chunk's copies and its slot (a job costs ~40 us here)."""
        job = self.copier.submit(_copy_rows, self.moves, then)
        self.moves = []
        if self.batch is not None:  # (none before the first row: a first output rejected)
            self.batch.copies.append(job)

    def carry_over(self, carry: Carry, stopping: Callable[[], bool]) -> None:
        """Add the carried rows, one old shard at a time (memory: one shard); each part goes in
        whole and in sample order once its last old shard is read. Ends early when `stopping`."""
        import zarr  # (only an incremental build carries rows: a fresh one never loads zarr)

        from batchctl.store.rowread import RowReader  # (nor the URL readers and their cache)

        group = zarr.open_group(carry.url, mode="r", **storage.zarr_options(carry.url, carry.storage_options))
        assert self.schema is not None
        stored = set(metadata.array_names(self.schema))
        old = RowReader(carry.url, {n: a for n, a in group.arrays() if n in stored}, carry.storage_options)
        last_run = {run.key: i for i, run in enumerate(carry.runs)}
        pending: dict[PathKey, list[tuple[CarryRun, dict[str, np.ndarray]]]] = {}
        number = 0
        try:
            for shard, runs in groupby(carry.runs, key=lambda run: run.shard):
                if stopping():
                    return
                shard_runs = list(runs)
                start = shard * carry.shard_rows
                end = start + max(run.start + run.rows for run in shard_runs)
                rows = {
                    name: old.ragged_rows(name, start, end) if spec.ragged else old.rows(name, start, end)
                    for name, spec in self.schema.items()
                }
                ready: list[PathKey] = []
                for run in shard_runs:
                    piece = {name: column[run.start : run.start + run.rows] for name, column in rows.items()}
                    pending.setdefault(run.key, []).append((run, piece))
                    if last_run[run.key] == number:
                        ready.append(run.key)
                    number += 1
                if ready:
                    self.add(_carried(ready, pending))
        finally:
            old.close()

    def _write_batch(self) -> None:
        """Write the full batch; a shard whose last batch this was gets its index."""
        self._append_batch()
        if self.next_batch % self._shard_batches() == 0:
            self._close_shards()
        elif time.monotonic() - self.last_sync >= SYNC_S:
            self._sync()

    def _append_batch(self) -> None:
        """Hand the batch to the writer threads to be encoded, placed in its shard (opened with
        its first batch) and written; it is journaled at the next sync after that."""
        assert self.batch is not None
        batch, rows = self.batch, self.batch.rows
        if not self.open:
            self._open_shards(self.next_batch // self._shard_batches(), {})
        columns = {name: batch.columns[name][:rows] for name in self.encoders if name in batch.columns}
        columns[metadata.SOURCE] = fmt.stored_column(self.arrays[metadata.SOURCE], metadata.SOURCE, batch.sources)
        for field_name in self.ragged:
            offsets, values = ragged.columns_of(batch.columns[field_name][:rows], self._spec(field_name))
            columns[metadata.offsets_array(field_name)] = offsets
            columns[metadata.values_array(field_name)] = values
        line = BatchLine(self.next_batch, self.open_index, rows, tuple(batch.entries))
        if self.moves:  # its rows' copies not yet handed over
            self.hand_over_copies()
        encoding = self.threads.submit(self._encode, columns, batch.copies)
        self.in_flight.append(_InFlight(line, encoding, batch.columns))
        self.samples += rows
        self.next_batch += 1
        self._advance()
        self.batch = self._new_batch()

    def _spec(self, field_name: str) -> metadata.FieldSpec:
        assert self.schema is not None
        return self.schema[field_name]

    def _encode(
        self, columns: dict[str, np.ndarray], copies: list[Future[None]]
    ) -> dict[str, list[tuple[list[Any], bytes]]]:
        """Each array's chunks of a batch (one, or a ragged field's values' several), encoded,
        and their digests (in this writer thread), once its rows are copied in."""
        for copy in copies:
            copy.result()
        encoded = {}
        for name, column in columns.items():
            field_name, part = metadata.ragged_part(name)
            if part == metadata.VALUES_SUFFIX:
                encoded[name] = self.ragged[field_name].encode(column)
            else:
                encoded[name] = [self.encoders[name].encode(column)]
        return {name: [(pieces, chunk_digest(pieces)) for pieces in chunks] for name, chunks in encoded.items()}

    def _advance(self, block: bool = False) -> None:
        """Place encoded batches in their shards in order and start writing them; take back the
        buffers of written ones and queue their lines for the journal. `block`: wait for the
        oldest batch in flight to be written."""
        for item in self.in_flight:
            if item.writing is not None:
                continue
            if not (block or item.encoding.done()):
                break
            pieces = item.encoding.result()
            item.writing = []
            for name, chunks in pieces.items():
                shard = self.open[name]
                chunk_pieces = [piece for each, _ in chunks for piece in each]
                place = shard.reserve([sum(len(piece) for piece in each) for each, _ in chunks])
                item.chunks[name] = place
                for _, digest in chunks:
                    shard.add_digest(digest)  # in placement order
                for start, data in _slices(chunk_pieces, place[0]):
                    item.writing.append(self.threads.submit(shard.write, start, data))
        while self.in_flight and self.in_flight[0].writing is not None:
            oldest = self.in_flight[0]
            if not (block or all(future.done() for future in oldest.writing or ())):
                break
            for future in oldest.writing or ():
                future.result()  # re-raises a failed write here
            self.in_flight.popleft()
            self.spare.append(oldest.buffers)
            self.unjournaled.append(replace(oldest.line, chunks=oldest.chunks))
            self.events.put(BatchWritten(oldest.line.rows))
            block = False
        self._journal_synced(wait=False)

    def _settle(self) -> None:
        """Wait until every batch handed over is written."""
        while self.in_flight:
            self._wait_for_writers()

    def _wait_for_writers(self) -> None:
        started = time.monotonic()
        self._advance(block=True)
        self.wait_s += time.monotonic() - started

    def _open_shards(self, shard: int, chunks: dict[str, list[Chunk]]) -> None:
        self.open_index = shard
        self.open = {
            name: shards.OpenShard(self.files, arr, shard, chunks.get(name, [])) for name, arr in self.arrays.items()
        }

    def _sync(self) -> None:
        """fsync the open shard files, then journal the batches they hold (local OUTPUT; an
        object store's shards are journaled whole when they are sent). The fsyncs run in the
        writer threads, the journal follows once they are done (`_journal_synced`): the kernel
        writes the page cache back in the thread that asks, which on disk cost the main thread
        ~25 us of CPU a photo here."""
        self.last_sync = time.monotonic()
        if self.paths.remote:
            return
        self._settle()
        self._journal_synced(wait=True)
        lines, self.unjournaled = self.unjournaled, []
        self.syncing = ([self.threads.submit(_timed_sync, shard) for shard in self.open.values()], lines)

    def _journal_synced(self, wait: bool) -> None:
        """Journal the lines of the last fsyncs once they are done (`wait`: wait for them)."""
        if self.syncing is None:
            return
        fsyncs, lines = self.syncing
        if not (wait or all(fsync.done() for fsync in fsyncs)):
            return
        started = time.monotonic()
        self.fsync_s += sum(fsync.result() for fsync in fsyncs) / max(len(fsyncs), 1)  # (they ran side by side)
        self.wait_s += time.monotonic() - started
        self.syncing = None
        self._append_journal(lines)

    def _close_shards(self) -> None:
        self._settle()
        self._journal_synced(wait=True)  # (its lines before this shard's last ones)
        started = time.monotonic()
        for open_shard in self.open.values():
            open_shard.finish(self._shard_batches())  # its index, then fsync
        self.fsync_s += time.monotonic() - started
        hashes = {name: open_shard.hash() for name, open_shard in self.open.items()}
        self.open = {}
        known = {name: found for name, found in hashes.items() if found is not None}
        self.unjournaled.append(ShardDone(self.open_index, known if len(known) == len(hashes) else {}))
        self._journal()

    def _journal(self) -> None:
        """Append the lines of what is now durable to the journal."""
        self._append_journal(self.unjournaled)
        self.unjournaled = []
        self.last_sync = time.monotonic()

    def _append_journal(self, lines: list[Line]) -> None:
        self.work.append_journal(lines)
        if lines:
            self.events.put(JournalLines(tuple(lines)))

    def finish(self) -> Finished:
        """Write the last, short batch and the last shard's index; the arrays' lengths last."""
        if self.batch is not None and self.batch.rows:
            self._write_batch()
        if self.open:
            self._close_shards()
        self._journal_synced(wait=True)
        self.threads.shutdown()
        self.copier.shutdown()
        batches = metadata.num_batches(self.samples, self.config.batch_size)
        for name, arr in self.arrays.items():
            self.arrays[name] = arr.resized(metadata.array_rows(name, self.samples, self.config.batch_size))
            self.files.write_array(self.arrays[name])
        schema = {name: spec.to_json() for name, spec in (self.schema or {}).items()}
        shard_batches = self.layout.shard_batches if self.layout else 0
        shards = -(-batches // shard_batches) if shard_batches else 0
        return Finished(self.samples, shards, shard_batches, schema, round(self.fsync_s, 3), round(self.wait_s, 3))

    def stop(self) -> Stopped:
        """Write and journal the half-filled batch too; the shard stays open (no index), and a
        resumed build fills that batch up. (An object store keeps only its finished shards.)"""
        if self.batch is not None and self.batch.rows:
            self._append_batch()
        self._settle()
        self._sync()
        self._journal_synced(wait=True)
        for shard in self.open.values():
            shard.close()
        self.threads.shutdown()
        self.copier.shutdown()
        return Stopped(self.samples)


def _timed_sync(shard: shards.OpenShard) -> float:
    started = time.monotonic()
    shard.sync()
    return time.monotonic() - started


def _copy_rows(pieces: list[tuple[np.ndarray, np.ndarray]], then: Callable[[], None] | None = None) -> None:
    for into, rows in pieces:
        into[...] = rows
    if then is not None:
        then()


def _append_run(entries: list[FileRun], run: FileRun) -> None:
    """One run per part per batch: rows of a part continuing the batch's last run join it (a
    resumed build goes on from the half-filled batch as the uninterrupted build would have)."""
    last = entries[-1] if entries else None
    if last is not None and last.key == run.key and not last.finished:
        entries[-1] = last._replace(rows=last.rows + run.rows, finished=run.finished)
    else:
        entries.append(run)


def _carried(keys: list[PathKey], pending: dict[PathKey, list[tuple[CarryRun, dict[str, np.ndarray]]]]) -> TaskOutput:
    """The carried rows of these parts as one output, each part's rows in sample order."""
    parts: list[tuple[SentTask, int]] = []
    columns: dict[str, list[np.ndarray]] = {}
    for key in keys:
        pieces = sorted(pending.pop(key), key=lambda piece: piece[0].index)
        first_run, rows = pieces[0][0], sum(run.rows for run, _ in pieces)
        part = (first_run.first, first_run.index + rows)
        parts.append((Task(0, first_run.item, part, skip=first_run.index - first_run.first).sent(), rows))
        for _, piece in pieces:
            for name, column in piece.items():
                columns.setdefault(name, []).append(column)
    return TaskOutput(parts, {name: np.concatenate(pieces) for name, pieces in columns.items()})


def _slices(pieces: list[Any], offset: int) -> Iterator[tuple[int, memoryview]]:
    """A chunk's pieces as (offset, bytes) slices of at most WRITE_SLICE bytes, so one big chunk
    is written by several threads at once."""
    for piece in pieces:
        view = memoryview(piece).cast("B")
        for start in range(0, len(view), WRITE_SLICE):
            yield offset + start, view[start : start + WRITE_SLICE]
        offset += len(view)


class Placement:
    """The collator's side of the workers' messages: each chunk's rows placed where the chunk
    stands in the dispatch order (`Reorder`), whatever order the workers finish in. An early
    chunk is held: in its ring slot while its worker has its other slot to fill, else copied
    out (freeing the worker). The bytes held are published in `held` for the parent's feed,
    which stops dispatching while they are many."""

    def __init__(self, collator: Collator, ring: SampleRing | None, held: Any, control: Connection) -> None:
        self.collator, self.ring, self.held, self.control = collator, ring, held, control
        # each held chunk's outputs, and its message while they still lie in its ring slot
        self.reorder: Reorder[tuple[list[TaskOutput], InRing | None]] = Reorder()

    def take(self, message: Sent) -> None:
        tasks = message.tasks
        if self.reorder.stale(tasks):  # a second copy of a chunk: its worker died after sending
            self._release(message.body)
        elif self.reorder.due(tasks):
            self._add(self._outputs(message.body))
            self._release_after_copies(message.body)
            self.reorder.placed(tasks)
            self._place_due()
        else:
            outputs, kept = self._early(message.body)
            self.reorder.hold(tasks, (outputs, kept), sum(c.nbytes for o in outputs for c in o.columns.values()))
        self.held.value = self.reorder.bytes

    def _early(self, body: InRing | list[TaskOutput]) -> tuple[list[TaskOutput], InRing | None]:
        """An early chunk's outputs as held: left in its ring slot (and its message, to free it
        once they are placed) while the worker's other slot is free, else copied out."""
        outputs = self._outputs(body)
        if isinstance(body, InRing) and self.ring is not None and self.ring.other_free(body.slot):
            return outputs, body
        owned = [_owned(output) for output in outputs]
        self._release(body)
        return owned, None

    def stop_asked(self) -> bool:
        """Read the parent's control messages waiting: True on Stop; lost tasks are settled."""
        while self.control.poll(0):
            message = self.control.recv()
            if isinstance(message, Lost):
                self.reorder.lost(message.tasks)
                self._place_due()
                self.held.value = self.reorder.bytes
            else:
                return True
        return False

    def finish(self) -> None:
        """End: every chunk has arrived, so nothing is held (were anything, it goes in, in order)."""
        for _, held in self.reorder.take_all():
            self._add_held(*held)

    def _place_due(self) -> None:
        while (due := self.reorder.take_due()) is not None:
            tasks, held = due
            self._add_held(*held)
            self.reorder.placed(tasks)

    def _add_held(self, outputs: list[TaskOutput], kept: InRing | None) -> None:
        """Place a held chunk's outputs; free the ring slot they were kept in once copied."""
        self._add(outputs)
        if kept is not None:
            self._release_after_copies(kept)

    def _add(self, outputs: list[TaskOutput]) -> None:
        for output in outputs:
            self.collator.add(output)

    def _outputs(self, body: InRing | list[TaskOutput]) -> list[TaskOutput]:
        if isinstance(body, InRing):
            assert self.ring is not None
            return self.ring.outputs(body)
        return body

    def _release(self, body: InRing | list[TaskOutput]) -> None:
        if isinstance(body, InRing):
            assert self.ring is not None
            self.ring.release(body)

    def _release_after_copies(self, body: InRing | list[TaskOutput]) -> None:
        """Free a placed chunk's ring slot once its rows are copied into their batches."""
        if isinstance(body, InRing):
            ring = self.ring
            assert ring is not None
            self.collator.hand_over_copies(then=lambda: ring.release(body))


def _owned(output: TaskOutput) -> TaskOutput:
    """An output whose columns no longer view a ring slot."""
    return TaskOutput(output.parts, {name: np.array(column) for name, column in output.columns.items()})


def _drain(inbox: SimpleQueue[Any], reader: Connection, placement: Placement) -> None:
    """On Stop, take the messages already in the inbox too: a worker's result reaches the parent
    only after its message is in the pipe, so these are samples the parent counted as done (what
    of them is not yet due is dropped with the rest, and done again by a resumed build). The
    workers are dead by now: one killed half-way through writing leaves a torn message, which
    would block a read for ever, so the pipe is read without blocking and the drain ends there."""
    os.set_blocking(reader.fileno(), False)
    while reader.poll(0):
        try:
            message = inbox.get()
        except Exception:  # noqa: BLE001 - a torn or undecodable message: the end of what arrived
            return
        if isinstance(message, End):
            return
        placement.take(message)


def run_collator(
    config: CollatorConfig,
    inbox: SimpleQueue[Any],
    control: Connection,
    events: Queue[Event],
    ring: SampleRing | None,
    held: Any,
) -> None:
    """Process entry point: collate until the parent's End and every task output it counts arrived,
    or until the parent says Stop on the control pipe."""
    init_child("batchctl-collator")
    try:
        collator = Collator(config, events)
        placement = Placement(collator, ring, held, control)
        if config.carry is not None and config.carry.runs:
            collator.carry_over(config.carry, placement.stop_asked)
        reader = queue_reader(inbox)
        # one poll object for the run: `multiprocessing.connection.wait` builds a selector each
        # call, ~90 us of this thread's CPU a message here
        poller = select.poll()
        for connection in (control, reader):
            poller.register(connection.fileno(), select.POLLIN)
        while True:
            if control.fileno() in dict(poller.poll()):
                if placement.stop_asked():
                    _drain(inbox, reader, placement)
                    events.put(collator.stop())
                    break
                continue
            message = inbox.get()
            if isinstance(message, End):
                placement.finish()
                events.put(collator.finish())
                break
            placement.take(message)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the build
        events.put(Crashed(f"the collator failed writing {config.work.paths.url}: {describe_error(exc)}"))
        events.close()
        events.join_thread()
        sys.exit(1)
