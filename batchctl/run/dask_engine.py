"""The Dask engine: preprocessing and shard writing spread over a dask.distributed cluster.

The client cuts the task list into groups of one shard's worth of samples; group g owns shard g.
A Dask task preprocesses its group and, when it got exactly one shard of rows, writes that shard
straight to the shared store; otherwise (skipped files, files of unexpected sample counts, the
last group) it stores its rows as a spill object. No two tasks ever write one shard, and a task
run twice (Dask retries, a lost worker) writes the same objects again. The client then closes
the gaps: full shards beyond the end move into the holes, spilled rows are written as the
remaining shards, and the metadata and `complete` flag are written last.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zarr

from batchctl.errors import UsageError
from batchctl.preprocess import Preprocessor, resolve
from batchctl.progress import Progress
from batchctl.records import Finished, Task, TaskResult, WorkItem
from batchctl.run import staging
from batchctl.run.rows import check_schema, columns_schema, preprocess_task, provenance_columns, runs_of
from batchctl.run.staging import BuildPaths
from batchctl.run.tally import Tally
from batchctl.run.writeplan import Carry, Outcome
from batchctl.store import format as fmt, metadata, ragged, storage, zarrmeta
from batchctl.store.journal import BatchLine, FileRun, GroupLine, Journaled
from batchctl.store.rowread import RowReader
from batchctl.store.storage import SourceRoot

GROUPS = 64  # groups a build is cut into at least (each worker thread of a 16-thread cluster gets ~4)


@dataclass(frozen=True)
class GroupSpec:
    """Everything a Dask task needs; plain data, pickled to the worker."""

    index: int  # the group's number
    shard: int  # the shard it owns
    tasks: list[Task]
    preprocess: str
    options: Mapping[str, Any]
    source: SourceRoot
    dataset: str  # the staging dataset: a shared path or a URL
    storage_options: Mapping[str, Any]
    spill: str  # where this group's rows go when they are not one whole shard
    layout: metadata.Layout
    schema: dict[str, metadata.FieldSpec]
    labelled: bool


@dataclass
class GroupResult:
    index: int
    results: list[TaskResult]
    rows: int
    full: bool  # wrote shard `index` whole; else its rows are in the spill object
    pid: int
    host: str


def plan_groups(tasks: list[Task], shard_rows: int, expected: Callable[[Task], int]) -> list[list[Task]]:
    """Consecutive tasks summing to one shard of expected samples each (the last one may be short)."""
    groups: list[list[Task]] = [[]]
    filled = 0
    for task in tasks:
        if groups[-1] and filled + expected(task) > shard_rows:
            groups.append([])
            filled = 0
        groups[-1].append(task)
        filled += expected(task)
    return [group for group in groups if group]


def run_group(spec: GroupSpec) -> GroupResult:
    """Dask task: preprocess one group, then write its shard, or spill its rows."""
    preprocessor: Preprocessor = resolve(spec.preprocess)
    results, outputs = [], []
    for task in spec.tasks:
        result, output = preprocess_task(task, preprocessor, spec.options, spec.source)
        if output is not None:
            reason = check_schema(spec.schema, columns_schema(output.columns))
            if reason:
                result = TaskResult(task, 0, reason)
                output = None
        results.append(result)
        if output is not None:
            outputs.append(output)
    columns = _columns(outputs, spec.schema, spec.labelled)
    rows = len(columns[metadata.SOURCE])
    full = rows == spec.layout.shard_rows
    if full:
        files = zarrmeta.DatasetFiles(spec.dataset, spec.storage_options)
        fmt.write_shard_at(files, files.arrays(), spec.layout, spec.shard, columns)
    else:
        _store_spill(spec.spill, spec.storage_options, columns)
    return GroupResult(spec.index, results, rows, full, os.getpid(), os.uname().nodename)


def _columns(outputs: list[Any], schema: Mapping[str, metadata.FieldSpec], labelled: bool) -> dict[str, np.ndarray]:
    """The rows of a group's outputs as dataset columns, provenance included."""
    columns: dict[str, np.ndarray] = {}
    for name, spec in schema.items():
        parts = [output.columns[name] for output in outputs]
        empty = np.empty(0, object) if spec.ragged else np.empty((0, *spec.shape), spec.dtype)
        columns[name] = np.concatenate(parts) if parts else empty
    columns.update(provenance_columns([run for output in outputs for run in runs_of(output)], labelled))
    return columns


# a spilled ragged field: its values end to end, and under this prefix its rows' lengths
RAGGED_SPILL = "ragged-lengths:"


def _store_spill(location: str, storage_options: Mapping[str, Any], columns: Mapping[str, np.ndarray]) -> None:
    buffer = io.BytesIO()
    arrays = {}
    for name, column in columns.items():
        if name == metadata.SOURCE:
            arrays[name] = column.astype(str)
        elif column.dtype == object:  # a ragged field
            arrays[RAGGED_SPILL + name] = np.fromiter((len(row) for row in column), np.int64, len(column))
            arrays[name] = np.concatenate(list(column)) if len(column) else np.empty(0)
        else:
            arrays[name] = column
    np.savez(buffer, **arrays)  # type: ignore[arg-type]
    fs, where = storage.locate(location, storage_options)
    fs.pipe_file(where, buffer.getvalue())


def read_spill(location: str, storage_options: Mapping[str, Any]) -> dict[str, np.ndarray]:
    fs, where = storage.locate(location, storage_options)
    raw = fs.cat_file(where)
    with np.load(io.BytesIO(raw)) as data:
        found = {name: data[name].astype(object) if data[name].dtype.kind == "U" else data[name] for name in data}
    for key in [key for key in found if key.startswith(RAGGED_SPILL)]:
        name, lengths = key[len(RAGGED_SPILL) :], found.pop(key)
        stops = np.cumsum(lengths)
        found[name] = ragged.rows_of(np.stack([stops - lengths, stops], axis=1), found[name])
    return found


@dataclass(frozen=True)
class Compaction:
    """How to make the shards contiguous: (from, to) moves of whole shards, then the indices the
    spilled rows fill, in order, the last one possibly partial."""

    moves: list[tuple[int, int]]
    spill_shards: list[int]
    total_rows: int


def plan_compaction(full: list[int], spill_rows: int, shard_rows: int) -> Compaction:
    """Full shards past the end of the final layout move into its holes; spilled rows fill the rest."""
    total = len(full) * shard_rows + spill_rows
    whole = total // shard_rows  # shard indices 0..whole-1 hold full shards in the end
    present = set(full)
    holes = [i for i in range(whole) if i not in present]
    movers = sorted(i for i in full if i >= whole)
    moves = list(zip(movers, holes, strict=False))
    rest = holes[len(moves) :]
    if total % shard_rows:
        rest.append(whole)
    return Compaction(moves, rest, total)


def move_shard(paths: BuildPaths, arrays: Mapping[str, zarrmeta.ArrayMeta], source: int, target: int) -> None:
    """Move one whole shard's objects (their bytes do not depend on where the shard sits)."""
    fs, root = storage.locate(paths.staging_url, paths.storage_options)
    for arr in arrays.values():
        src, dst = (f"{root}/{arr.shard_key(shard)}" for shard in (source, target))
        if fs.exists(src):
            fs.mv(src, dst)


def spill_rows(spills: list[dict[str, np.ndarray]], shard_rows: int) -> Iterator[dict[str, np.ndarray]]:
    """Spilled rows regrouped into shards of `shard_rows` (the last one shorter)."""
    if not spills:
        return
    names = list(spills[0])
    merged = {name: np.concatenate([spill[name] for spill in spills]) for name in names}
    total = len(merged[metadata.SOURCE])
    for start in range(0, total, shard_rows):
        yield {name: column[start : start + shard_rows] for name, column in merged.items()}


@dataclass(frozen=True)
class DaskJob:
    """What a build hands the Dask engine: plain settings, what is already there, and where to
    report. `base` shards are in the staging dataset already (kept whole from the last build);
    `kept_groups` are the journal lines of groups an interrupted run finished; `carry` the rows
    of unchanged files to copy over from the last build; `stamps` every file's, for the record."""

    work: staging.Workdir  # the build's work folder (its one owner: the builder made it)
    source: SourceRoot
    preprocessor: Preprocessor
    pp_options: Mapping[str, Any]
    batch_size: int
    shard_batches: int | None
    compression: str
    workers: int
    scheduler: str | None
    labelled: bool
    source_bytes: int
    tally: Tally
    progress: Progress
    base: int = 0
    kept_groups: tuple[GroupLine, ...] = ()
    carry: Carry | None = None
    stamps: Mapping[str, WorkItem] = field(default_factory=dict)


class DaskRun:
    """The client's side of a Dask build: probe the schema, submit the groups, journal each as it
    finishes, then close the gaps between shards."""

    def __init__(self, job: DaskJob) -> None:
        self.job = job
        self.work = job.work
        self.paths = job.work.paths
        self.files = self.paths.staging_files
        self.workers_seen: set[str] = set()

    def run(self, tasks: list[Task]) -> Outcome:
        """Build the staging dataset; what was made: its `Finished` and its batches (every row's
        file, for the record: read from its `source` columns, as the client moved rows about)."""
        arrays = self.files.arrays()
        if arrays:  # resumed, or seeded from the last build: the arrays say what they hold
            schema = metadata.schema_of_arrays(arrays)
            rows: dict[str, np.ndarray] = {}
        else:
            probed = self._probe_schema(tasks)
            if probed is None:
                return Outcome(Finished(0, 0, 0, {}), Journaled())
            schema, rows = probed
        client, cluster = self._client()
        try:
            finished = self._run(tasks, schema, rows, client)
        finally:
            client.close()
            if cluster is not None:
                cluster.close()
        batches = batches_from_columns(self.paths, self.job.batch_size, self.job.stamps)
        return Outcome(finished, Journaled(tuple(batches)))

    def _shard_batches(self, tasks: list[Task], schema: dict[str, metadata.FieldSpec]) -> int:
        """The usual ~128 MiB shards, but small enough for about GROUPS groups: a group is one
        Dask task, and a data set of few shards would leave workers idle. Not the cluster's
        size: a dataset must not depend on how many workers built it."""
        if self.job.shard_batches:
            return int(self.job.shard_batches)
        batches = -(-sum(_expected_rows(task) for task in tasks) // self.job.batch_size)
        spread = max(metadata.MIN_SHARD_BATCHES, -(-batches // GROUPS))
        return int(min(metadata.default_shard_batches(self.job.batch_size, schema), spread))

    def _arrays(
        self, tasks: list[Task], schema: dict[str, metadata.FieldSpec], rows: dict[str, np.ndarray]
    ) -> tuple[dict[str, zarrmeta.ArrayMeta], metadata.Layout]:
        """The staging arrays: there already (their layout stands), or created now."""
        arrays = self.files.arrays()
        if arrays:
            shard_rows = arrays[metadata.SOURCE].grid[0]
            return arrays, metadata.Layout(self.job.batch_size, shard_rows // self.job.batch_size)
        layout = metadata.Layout(self.job.batch_size, self._shard_batches(tasks, schema))
        job = self.job
        return fmt.create_arrays(
            self.files, schema, layout, job.compression, job.labelled, job.source_bytes, rows
        ), layout

    def _run(
        self, tasks: list[Task], schema: dict[str, metadata.FieldSpec], rows: dict[str, np.ndarray], client: Any
    ) -> Finished:
        arrays, layout = self._arrays(tasks, schema, rows)
        first = max((line.group for line in self.job.kept_groups), default=-1) + 1
        groups = plan_groups(tasks, layout.shard_rows, _expected_rows)
        for name, arr in arrays.items():  # sized for every group's shard up front: tasks write no metadata
            rows_up_front = (self.job.base + first + len(groups)) * layout.shard_rows
            arrays[name] = arr.resized(metadata.array_rows(name, rows_up_front, layout.batch_size))
            self.files.write_array(arrays[name])
        if not self.paths.remote:
            os.makedirs(os.path.dirname(self.paths.spill_url(0)), exist_ok=True)
        done: list[GroupLine] = list(self.job.kept_groups)
        if self.job.carry is not None and self.job.carry.runs:
            done.append(self._write_carry(self.job.carry, schema))
        specs = [
            GroupSpec(
                index=first + number,
                shard=self._shard_of(first + number),
                tasks=group,
                preprocess=self.job.preprocessor.name,
                options=self.job.pp_options,
                source=self.job.source,
                dataset=self.paths.staging_url,
                storage_options=dict(self.paths.storage_options),
                spill=self.paths.spill_url(first + number),
                layout=layout,
                schema=schema,
                labelled=self.job.labelled,
            )
            for number, group in enumerate(groups)
        ]
        done += self._submit(client, specs, layout)
        samples = self._compact(arrays, layout, done)
        shards = -(-samples // layout.shard_rows)
        return Finished(samples, shards, layout.shard_batches, {name: spec.to_json() for name, spec in schema.items()})

    def _shard_of(self, group: int) -> int:
        return self.job.base + group

    def _write_carry(self, carry: Carry, schema: Mapping[str, metadata.FieldSpec]) -> GroupLine:
        """The rows carried over from the last build, as one spill (group -1), journaled."""
        old = zarr.open_group(carry.url, mode="r", **storage.zarr_options(carry.url, carry.storage_options))
        stored = set(metadata.array_names(schema))
        reader = RowReader(carry.url, {n: a for n, a in old.arrays() if n in stored}, carry.storage_options)
        pieces: dict[str, list[np.ndarray]] = {name: [] for name in schema}
        for run in carry.runs:
            start = run.shard * carry.shard_rows + run.start
            for name, spec in schema.items():
                read = reader.ragged_rows if spec.ragged else reader.rows
                pieces[name].append(read(name, start, start + run.rows))
        reader.close()
        columns = {name: np.concatenate(parts) for name, parts in pieces.items()}
        runs = [(run.item.relpath, run.index, run.item.label, run.rows) for run in carry.runs]
        columns.update(provenance_columns(runs, self.job.labelled))
        _store_spill(self.paths.spill_url(-1), self.paths.storage_options, columns)
        files = tuple(FileRun(r.item.relpath, r.rows, True, r.item.size, r.item.mtime_ns, r.first) for r in carry.runs)
        line = GroupLine(-1, False, len(columns[metadata.SOURCE]), files)
        self.work.append_group(line)
        return line

    def _probe_schema(self, tasks: list[Task]) -> tuple[dict[str, metadata.FieldSpec], dict[str, np.ndarray]] | None:
        """The schema and rows of the first file that preprocesses, here in the client (one file's
        work; `auto` compression measures the rows). None when no file does: each was tallied."""
        results = []
        for task in tasks:
            result, output = preprocess_task(task, self.job.preprocessor, self.job.pp_options, self.job.source)
            if output is not None:
                found = columns_schema(output.columns)
                reason = check_schema(found, found)
                if reason is None:
                    return found, output.columns
                result = TaskResult(task, 0, reason)
            results.append(result)
        for result in results:
            self.job.tally.result(result)
            self.job.progress.files_done()
        return None

    def _client(self) -> Any:
        try:
            from distributed import Client, LocalCluster
        except ImportError:
            raise UsageError("--engine dask needs dask.distributed: pip install 'batchctl[dask]'") from None
        if self.job.scheduler:
            return Client(self.job.scheduler, timeout="30s"), None
        cluster = LocalCluster(n_workers=self.job.workers, threads_per_worker=1, processes=True, dashboard_address=None)
        return Client(cluster), cluster

    def _submit(self, client: Any, specs: list[GroupSpec], layout: metadata.Layout) -> list[GroupLine]:
        """Run the groups; each one's journal line once it is done (its shard or spill is written)."""
        from distributed import as_completed

        futures = []
        lines = []
        try:
            futures = [client.submit(run_group, spec, retries=3, pure=False) for spec in specs]
            for future in as_completed(futures):
                result: GroupResult = future.result()
                self.workers_seen.add(f"{result.host}:{result.pid}")
                files = tuple(
                    FileRun(r.task.item.relpath, r.samples, True, r.task.item.size, r.task.item.mtime_ns, r.task.first)
                    for r in result.results
                    if r.samples
                )
                line = GroupLine(result.index, result.full, result.rows, files)
                self.work.append_group(line)
                lines.append(line)
                for task_result in result.results:
                    self.job.tally.result(task_result)
                    self.job.progress.files_done()
                if result.full:
                    self.job.progress.batches_written(layout.shard_batches)
            return lines
        finally:
            client.cancel(futures)

    def _compact(self, arrays: dict[str, zarrmeta.ArrayMeta], layout: metadata.Layout, done: list[GroupLine]) -> int:
        """Make the shards contiguous; the dataset's number of samples."""
        full = list(range(self.job.base)) + sorted(self._shard_of(g.group) for g in done if g.full)
        spilled = sorted((g for g in done if not g.full and g.rows), key=lambda g: g.group)
        plan = plan_compaction(full, sum(g.rows for g in spilled), layout.shard_rows)
        for source, target in plan.moves:
            move_shard(self.paths, arrays, source, target)
        for name, arr in arrays.items():
            arrays[name] = arr.resized(metadata.array_rows(name, plan.total_rows, layout.batch_size))
            self.files.write_array(arrays[name])
        # a longer previous build's shards past the end
        fmt.remove_shards_from(self.files, arrays, -(-plan.total_rows // layout.shard_rows))
        spills = [read_spill(self.paths.spill_url(g.group), self.paths.storage_options) for g in spilled]
        for index, columns in zip(plan.spill_shards, spill_rows(spills, layout.shard_rows), strict=True):
            fmt.write_shard_at(self.files, arrays, layout, index, columns)
        return plan.total_rows


def _expected_rows(task: Task) -> int:
    return task.part[1] - task.part[0] - task.skip if task.part else 1


def batches_from_columns(paths: BuildPaths, batch_size: int, stamps: Mapping[str, WorkItem]) -> list[BatchLine]:
    """The batches of a Dask build's staging dataset, for its record: the client moved rows
    about, so they are read from its `source` and `source_index` columns (one file run per run of
    consecutive samples of one file within a batch)."""
    group = zarr.open_group(paths.staging_url, mode="r", **paths.zarr_kwargs())
    arrays = dict(group.arrays())
    sources = fmt.decode_sources(np.asarray(arrays[metadata.SOURCE][:])).tolist()
    indices = np.asarray(arrays[metadata.SOURCE_INDEX][:]).tolist()
    shard_rows = paths.staging_files.arrays()[metadata.SOURCE].grid[0]
    batches = []
    for number, start in enumerate(range(0, len(sources), batch_size)):
        runs: list[FileRun] = []
        end = start + batch_size
        for relpath, index in zip(sources[start:end], indices[start:end], strict=True):
            last = runs[-1] if runs else None
            if last is not None and last.source == relpath and last.first + last.rows == index:
                runs[-1] = last._replace(rows=last.rows + 1)
            else:
                item = stamps[relpath]
                runs.append(FileRun(relpath, 1, True, item.size, item.mtime_ns, index))
        rows = min(batch_size, len(sources) - start)
        batches.append(BatchLine(number, start // shard_rows, rows, tuple(runs)))
    return batches
