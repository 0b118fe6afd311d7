"""Build: lock -> discover -> plan the start -> run an engine -> publish.

`build()` is the Python API `batchctl build` calls. The start (resume, incremental or fresh) is
planned by `batchctl.plan.start` from what `batchctl.prepare` reads, the files are preprocessed by
the local pipeline (`batchctl.run.pipeline`) or a Dask cluster (`batchctl.run.dask_engine`),
counted by one `Tally`, and the dataset is published by `batchctl.publish`.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Unpack

from batchctl.errors import BuildFailed, BuildInterrupted, PipelineError, UsageError
from batchctl.plan import tables
from batchctl.plan.discover import Discovery, check_source, discover, hash_files, shuffled, watch_reads
from batchctl.plan.inputs import SOURCE, PythonInputs, is_python_inputs, path_inputs, spill_inputs
from batchctl.plan.options import BuildKwargs, BuildOptions, build_options, dataset_spec, default_workers
from batchctl.plan.start import Interrupted, Published, Request, Start, plan_resume, plan_start, untrusted_work
from batchctl.plan.tasks import make_tasks
from batchctl.prepare import Output, damaged_shards, prepare, read_interrupted, read_output, read_published
from batchctl.preprocess import builtins, resolve
from batchctl.progress import ConsoleProgress, Progress
from batchctl.publish import Origin, dataset_attrs, publish, record_of
from batchctl.records import Finished, Task, describe_error
from batchctl.report import BuildReport, Changes, FileError
from batchctl.run import staging
from batchctl.run.lock import BuildLock, LockUnavailable
from batchctl.run.mpinternals import semaphores_named_after
from batchctl.run.pipeline import Pipeline, PipelineConfig
from batchctl.run.processes import (
    TEMP_PREFIX,
    leave_if_reimporting_main,
    refuse_main_children_cannot_run,
    signals_raise,
    start_forkserver,
    sweep_dead_builds,
)
from batchctl.run.signals import Signalled, check_signalled, published, signal_handled, signalled_in
from batchctl.run.staging import BuildPaths
from batchctl.run.tally import Tally
from batchctl.run.writeplan import Carry, CollatorConfig, Outcome
from batchctl.store import metadata as meta, storage
from batchctl.store.digest import hashes_by_key
from batchctl.store.journal import Untrusted
from batchctl.store.storage import SourceRoot

__all__ = ["BuildKwargs", "BuildOptions", "build"]


def build(
    source: str | os.PathLike[str] | Iterable[Any],
    output: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
    *,
    input_key: Callable[[Any], str] | None = None,
    **options: Unpack[BuildKwargs],
) -> BuildReport:
    """Preprocess every file under `source` into the sharded dataset `output` (by default SOURCE's
    name plus `.zarr`, beside it). The options are `batchctl build`'s, as keywords of the same
    names (`BuildKwargs`).

    `source` may instead be Python inputs: any iterable, whose items `preprocess=fn` takes one by
    one (`fn(item)`), each named by `input_key(item)` (default: a path's text, an int, else its index),
    or a map-style dataset (`len` + `__getitem__`), whose `fn(dataset[i])` the workers run.

    Returns the report of a complete (or already up-to-date) build; raises `BuildFailed` or
    `BuildInterrupted`, both carrying the report, when it ends otherwise.
    """
    leave_if_reimporting_main()
    given: dict[str, Any] = dict(options)
    report_path, quiet = given.pop("report", None), given.pop("quiet", None)
    opts = build_options(**given)
    if progress is None:
        progress = Progress() if quiet is None else ConsoleProgress(quiet=bool(quiet))
    if is_python_inputs(source):
        if output is None:
            raise UsageError("build(inputs, output): a dataset built from Python inputs needs an output path")
        inputs = PythonInputs(source, input_key)
        builder = _Builder(SOURCE, storage.normalise(output), opts, progress, inputs)
    else:
        if input_key is not None:
            raise UsageError("input_key= names Python inputs; a SOURCE's files are named by their paths")
        assert isinstance(source, (str, os.PathLike))
        where = storage.default_output(source) if output is None else storage.normalise(output)
        builder = _Builder(storage.normalise(source), where, opts, progress)
    try:
        result = builder.run()
    except (BuildFailed, BuildInterrupted) as exc:
        _write_report(exc.report, report_path)
        raise
    _write_report(result, report_path)
    if quiet is False:
        print(result.summary(), file=sys.stderr)
    return result


def _write_report(report: BuildReport, path: str | os.PathLike[str] | None) -> None:
    if path is not None:
        report.write(Path(path))


class _Builder:
    def __init__(
        self, source: str, output: str, options: BuildOptions, progress: Progress, inputs: PythonInputs | None = None
    ) -> None:
        self.source, self.output, self.options, self.progress = source, output, options, progress
        self.inputs = inputs
        self.root = tables.files_root(source)  # where the inputs' paths start (a table SOURCE's folder)
        self.spill = ""  # where Python inputs are pickled for the workers
        if inputs is not None:
            _refuse_for_python_inputs(options)
            self.root = os.getcwd()  # (relative paths given to a built-in start here)
        resolved = resolve(options.preprocess)
        self.preprocessor = dataclasses.replace(resolved, include=tuple(options.include) or resolved.include)
        self.pp_options = self.preprocessor.options(options.preprocess_options)
        if inputs is not None and not self._takes_paths:
            self.spill = _spill_folder()
        self.spec = dataset_spec(options, self.preprocessor, self.pp_options)
        self.paths = BuildPaths(output, options.storage_options)
        self.work = staging.workdir(self.paths)
        self.report = BuildReport(str(source), output)
        self.tally = Tally(self.report, progress, options.max_errors)
        self.started = time.monotonic()
        self.marks: dict[str, float] = {}  # when the start's stages ended (`_time_stages`)
        self.digests: dict[str, str] = {}  # --checksum: each input's content hash

    def run(self) -> BuildReport:
        try:
            return self._run()
        finally:
            if self.spill:  # (the workers are gone: nothing reads it now)
                shutil.rmtree(self.spill, ignore_errors=True)

    def _run(self) -> BuildReport:
        published(False)
        if self.inputs is None:
            check_source(self.source)  # a typo is a usage error that leaves nothing behind, no lock file either
        if storage.is_url(self.output):
            _check_store_reachable(self.paths)
        elif not self.paths.output.parent.is_dir():
            _make_folder(self.paths.output.parent)
        self.work.check()
        try:
            lock = BuildLock(self.paths.lock).acquire()
        except LockUnavailable:  # a folder this user cannot write: enough to say a dataset is up to date
            if self.options.force:
                raise
            if self._up_to_date(self._fingerprint(self._discover()), read_output(self.paths)):
                return self._end("up_to_date")
            raise
        with lock, signals_raise():
            try:
                return self._run_locked()
            except (Signalled, Exception) as exc:
                signalled = signalled_in(exc)
                if signalled is not None:
                    signal_handled()
                    self._end("interrupted", "interrupted; rerun the same command to resume")
                    raise BuildInterrupted(signalled.signum, self.report) from None
                if isinstance(exc, (PipelineError, OSError)):
                    text = str(exc) if isinstance(exc, PipelineError) else _os_error_text(exc)
                    self._end("failed", text)
                    raise BuildFailed(text, self.report) from None
                if isinstance(exc, BuildFailed):
                    self._end("failed", str(exc))
                raise

    def _run_locked(self) -> BuildReport:
        check_signalled()  # checkpoints: a signal whose raise library code swallowed is acted on here
        sweep_dead_builds()  # what builds killed with their whole process group left in /dev/shm
        output = self._recover_publish()
        discovery = self._discover()
        for note in discovery.notes:
            self.progress.info(note)
        fingerprint = self._fingerprint(discovery)
        if not self.options.force and self._up_to_date(fingerprint, output):
            return self._end("up_to_date")
        self.work.check_replaceable()
        self.marks["discovered"] = time.monotonic()
        if self.options.engine == "local":
            refuse_main_children_cannot_run()
            start_forkserver()  # there is work (the CLI started it already): its preloads run alongside our planning
        if not discovery.items and self.inputs is not None:
            raise BuildFailed("nothing to build: the Python inputs hold no item", self.report)
        if not discovery.items:
            raise BuildFailed(
                f"nothing to build: no file under {self.source} is taken by the {self.preprocessor.name!r} "
                f"preprocessor ({', '.join(self.preprocessor.include or self.preprocessor.extensions or ('any',))})",
                self.report,
            )
        start = self._start(discovery, output)
        written = start.written()
        tasks = make_tasks(self.preprocessor, self.pp_options, self.root, discovery.items, written, start.only)
        check_signalled()
        self.marks["planned"] = time.monotonic()
        self.tally.files = len(discovery.items) + len(discovery.unreadable)
        for relpath, reason in discovery.unreadable:
            self.tally.error(relpath, reason)
        self.report.carried_samples = sum(run.rows for run in start.carry)
        split = any(task.part for task in tasks)
        self.progress.start(len(tasks), len(start.kept.batches), split, self.report.carried_samples)
        source = self._source_root(discovery, tasks)
        if self.options.engine == "dask":
            outcome = self._run_dask(discovery, start, tasks, source)
        else:
            outcome = self._run_local(discovery, start, tasks, source)
        self.progress.close()
        if outcome.finished.samples == 0:
            raise BuildFailed(f"no samples were produced: all {len(discovery.items)} files were skipped", self.report)
        self.tally.check_mostly_skipped()
        return self._complete(discovery, fingerprint, outcome)

    def _start(self, discovery: Discovery, output: Output) -> Start:
        """Plan where this build starts from what is on disk, and set the work folder up for it."""
        self.report.in_place = self.paths.remote  # from here on a URL OUTPUT is written in place
        keep_tail = self.options.engine == "local" and not self.paths.remote  # only the collator appends to a shard
        request = Request(
            spec=self.spec,
            source=str(self.source),
            classes=discovery.classes,
            items=discovery.items,
            batch_size=self.options.batch_size,
            engine=self.options.engine,
            resume=self.options.resume,
            force=self.options.force,
            checksum=self.options.checksum,
            digests=self.digests,
            row_hashes=discovery.row_hashes,
            keep_tail=keep_tail,
            carry_from=f"{self.paths.workdir_url}/previous.zarr" if self.paths.remote else self.output,
            work_url=self.paths.workdir_url,
            record_url=self.paths.record_url,
        )
        interrupted = None
        if self.options.resume:
            try:
                interrupted = read_interrupted(self.paths, self.work, self.options.batch_size)
            except Untrusted as exc:
                raise untrusted_work(self.paths.workdir_url, exc) from None
        start = plan_resume(request, interrupted)
        facts = None
        if start is None:  # the published dataset is read only when the interrupted build is not resumed
            start, facts = self._checked_start(request, interrupted, read_published(self.paths, output, keep_tail))
        for note in start.notes:
            self.progress.info(note)
        staging_attrs = dataset_attrs(self._origin(discovery), [])
        prepare(start, request, self.paths, self.work, staging_attrs, interrupted, facts)
        for relpath, skipped in start.skipped.items():
            self.report.errors.append(FileError(relpath, skipped.reason, skipped.retry))
        if start.changes is not None:
            self.report.changes = Changes.of(start.changes)
        self.report.kept_samples = start.kept_samples
        self.report.resumed_shards, self.report.resumed_samples = start.resumed_shards, start.resumed_samples
        return start

    def _checked_start(
        self, request: Request, interrupted: Interrupted | None, facts: Published
    ) -> tuple[Start, Published]:
        """The start `plan_start` gives, planned again when shards an incremental build would keep
        are damaged (`damaged_shards`): their files are preprocessed again, nothing unsound is
        linked into the new dataset or vouched for by its digest. Returns the facts it used."""
        start = plan_start(request, interrupted, facts)
        if start.seed is None:
            return start, facts
        damaged = damaged_shards(self.paths, facts, start.seed.kept_shards)
        if not damaged:
            return start, facts
        facts = dataclasses.replace(facts, damaged=damaged)
        return plan_start(request, interrupted, facts), facts

    def _carry(self, start: Start) -> Carry | None:
        """An incremental build's rows to carry over from the last build (None: not incremental)."""
        seeded = start.state.incremental
        if seeded is None:
            return None
        return Carry(seeded.carry_from, dict(self.options.storage_options), start.carry_shard_rows, list(start.carry))

    def _source_root(self, discovery: Discovery, tasks: list[Task]) -> SourceRoot:
        """The inputs as the workers see them: the files a Parquet SOURCE holds for these tasks
        written out first, into the work folder (removed with it once published; on this machine
        for a URL OUTPUT, removed when the build ends)."""
        if self.spill and self.inputs is not None:
            return SourceRoot(self.spill, rows=self.spill, inputs="dataset" if self.inputs.map_style else "items")
        if discovery.content is None:
            return SourceRoot(self.root, self.options.storage_options)
        table, column = discovery.content
        if self.paths.remote:
            folder = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-rows-"))  # (swept if we are killed)
            atexit.register(shutil.rmtree, folder, True)
        else:
            folder = self.paths.workdir / "rows"
        lines = {line for task in tasks if (line := tables.content_line(task.item.relpath, table)) is not None}
        write = tables.write_texts if self._text_column else tables.write_contents
        write(Path(self.root) / table, column, lines, folder)
        return SourceRoot(self.root, self.options.storage_options, str(folder), table)

    def _run_local(self, discovery: Discovery, start: Start, tasks: list[Task], source: SourceRoot) -> Outcome:
        cores = default_workers()
        if self.options.workers > cores:  # as PyTorch's DataLoader warns: said once, the number kept
            self.progress.info(
                f"note: --workers {self.options.workers} is more than the {cores} cores this build may use; "
                f"the workers share them, which is slower than --workers {cores}"
            )
        config = PipelineConfig(
            self.preprocessor,
            self.pp_options,
            source,
            self.options.workers,
            self.options.timeout,
            collator=CollatorConfig(
                work=self.work,
                batch_size=self.options.batch_size,
                shard_batches=self.options.shard_batches,
                compression=self.options.compression,
                labelled=discovery.classes is not None,
                source_bytes=meta.source_width(item.relpath for item in discovery.items),
                resume=start.kept,
                carry=self._carry(start),
            ),
        )
        with semaphores_named_after(os.getpid()):  # what a SIGKILL of the whole group leaves, a later build sweeps
            pipeline = Pipeline(config, self.progress, self.tally)
            outcome = pipeline.run(tasks)
        self._time_stages(pipeline, outcome.finished)
        return outcome

    def _time_stages(self, pipeline: Pipeline, finished: Finished) -> None:
        """Where a local build's time went, for the report (`timings`)."""
        timings = self.report.timings
        if pipeline.dispatching is not None and pipeline.last_result is not None:
            timings["start_s"] = pipeline.dispatching - self.started
            if {"discovered", "planned"} <= self.marks.keys():
                timings["discover_s"] = self.marks["discovered"] - self.started
                timings["plan_s"] = self.marks["planned"] - self.marks["discovered"]
                timings["pool_s"] = pipeline.dispatching - self.marks["planned"]
            timings["preprocess_s"] = pipeline.last_result - pipeline.dispatching
            timings["finish_s"] = time.monotonic() - pipeline.last_result
        timings.update(fsync_s=finished.fsync_s, writer_wait_s=finished.wait_s)
        for name, seconds in timings.items():
            timings[name] = round(seconds, 3)

    def _run_dask(self, discovery: Discovery, start: Start, tasks: list[Task], source: SourceRoot) -> Outcome:
        from batchctl.run.dask_engine import DaskJob, DaskRun

        job = DaskJob(
            work=self.work,
            source=source,
            preprocessor=self.preprocessor,
            pp_options=self.pp_options,
            batch_size=self.options.batch_size,
            shard_batches=self.options.shard_batches,
            compression=self.options.compression,
            workers=self.options.workers,
            scheduler=self.options.scheduler,
            labelled=discovery.classes is not None,
            source_bytes=meta.source_width(item.relpath for item in discovery.items),
            tally=self.tally,
            progress=self.progress,
            base=start.kept.done_shards,
            kept_groups=start.kept.groups,
            carry=self._carry(start),
            stamps={item.relpath: item for item in discovery.items},
        )
        run = DaskRun(job)
        outcome = run.run(tasks)
        self.report.workers_seen = sorted(run.workers_seen)
        return outcome

    def _complete(self, discovery: Discovery, fingerprint: str, outcome: Outcome) -> BuildReport:
        check_signalled()
        retry = {error.source for error in self.report.errors if error.retry}
        if retry:  # files lost with their worker: the next run must not find this dataset up to date
            fingerprint = discovery.fingerprint([self.spec, discovery.classes], leave_out=retry, digests=self.digests)
        origin, finished, journal = self._origin(discovery), outcome.finished, outcome.journal
        batches = journal.batches
        arrays = self.paths.staging_files.arrays()  # as the engine left them
        width = arrays[meta.SOURCE].shape[1]
        record = record_of(
            origin, batches, finished, discovery.items, self.report.errors, width, self.digests, discovery.row_hashes
        )
        notes = dict(self.preprocessor.describe(self.pp_options) if self.preprocessor.describe else {})
        for name in discovery.texts:  # (what a reader that opens the array alone needs to read it as text)
            notes[name] = {"attributes": meta.TEXT_ATTRIBUTES, "dimension_names": [f"{name}_byte"]}
        attrs = dataset_attrs(origin, self.report.errors, finished)
        known = hashes_by_key(arrays, journal.hashes)
        publishing = time.monotonic()
        self.report.digest = publish(self.work, self.paths, attrs, record, notes, fingerprint, known, arrays)
        self.report.timings["publish_s"] = round(time.monotonic() - publishing, 3)
        for warning in self.work.warnings:
            self.progress.info(warning)
        self.report.samples = finished.samples
        self.report.batches = meta.num_batches(finished.samples, self.options.batch_size)
        self.report.shards = finished.shards
        self.report.bytes = storage.tree_bytes(self.output, self.options.storage_options)
        return self._end("complete")

    def _origin(self, discovery: Discovery) -> Origin:
        return Origin(
            source=str(self.source),
            spec=self.spec,
            batch_size=self.options.batch_size,
            shard_batches=self.options.shard_batches,
            compression=self.options.compression,
            checksum=self.options.checksum,
            classes=discovery.classes,
            ignored=discovery.ignored,
            ignored_paths=discovery.ignored_paths,
        )

    def _discover(self) -> Discovery:
        if self.inputs is not None:
            return self._discover_inputs(self.inputs)
        discovery = discover(
            self.source,
            self.preprocessor.accepts,
            self.options.seed,
            self.options.storage_options,
            self.output,
            self.options.label,
            self.options.path_column,
            self._text_column,
        )
        watch_reads(discovery, self.source, self.preprocessor.reads)
        self.report.ignored, self.report.ignored_paths = discovery.ignored, discovery.ignored_paths
        if discovery.texts:  # a wider text field is another layout: the spec says its width
            self.spec = {**self.spec, "text": dict(sorted(discovery.texts.items()))}
        return discovery

    @property
    def _text_column(self) -> str | None:
        """The text preprocessor's column of documents in a table SOURCE (`--option column=text`)."""
        column = self.pp_options.get("column") if self.preprocessor.name == "text" else None
        return str(column) if column else None

    @property
    def _takes_paths(self) -> bool:
        """A built-in preprocessor takes Python inputs as paths (or URLs) to open."""
        return self.preprocessor.name in builtins()

    def _discover_inputs(self, inputs: PythonInputs) -> Discovery:
        """Python inputs: paths for a built-in, else pickled into the spill folder as they are met."""
        if self.preprocessor.reads:
            raise UsageError("the plugin declares files it reads (@reads), which Python inputs do not have beside them")
        if self._takes_paths:
            items, refused = path_inputs(inputs, self.preprocessor.name)
            hashes: dict[str, str] = {}
        else:
            items, hashes, refused = spill_inputs(inputs, Path(self.spill))
        return Discovery(shuffled(items, self.options.seed), None, unreadable=refused, row_hashes=hashes)

    def _fingerprint(self, discovery: Discovery) -> str:
        """What a dataset built from these files with these options says it was built from."""
        if self.options.checksum and not self.spill:  # (a pickled input's row hash is its content's already)
            self.digests = hash_files(self.root, discovery.items, self.options.storage_options, self.options.workers)
        return discovery.fingerprint([self.spec, discovery.classes], digests=self.digests)

    def _recover_publish(self) -> Output:
        """A run killed while publishing: finish it, or drop its marker so the build resumes.
        Returns the dataset at OUTPUT as it is then (read again only when a publish was recovered)."""
        output = read_output(self.paths)
        done = self.work.recover(output.attrs.build_id if output.complete and output.attrs else None)
        if done is None:
            return output
        if done:
            self.progress.info(done)
        return read_output(self.paths)

    def _up_to_date(self, fingerprint: str, output: Output) -> bool:
        attrs, info = output.attrs, output.info
        if attrs is None or not attrs.complete:
            return False
        if info is None or info.fingerprint != fingerprint or info.digest != attrs.digest:
            return False
        self.report.digest = attrs.digest
        self.report.samples, self.report.batches, self.report.shards = (
            attrs.num_samples,
            attrs.num_batches,
            attrs.num_shards,
        )
        self.report.bytes = storage.tree_bytes(self.output, self.options.storage_options)
        return True

    def _end(self, status: Any, message: str = "") -> BuildReport:
        self.progress.close()
        self.report.status = status
        self.report.message = message
        self.report.elapsed_s = round(time.monotonic() - self.started, 3)
        written = self.tally.new_samples + self.report.carried_samples  # this run's work: preprocessed and carried
        self.report.samples_per_s = round(written / max(self.report.elapsed_s, 1e-9), 1)
        if status in ("interrupted", "failed"):
            self.report.samples = self.tally.new_samples
        return self.report


def _refuse_for_python_inputs(options: BuildOptions) -> None:
    """The options that name a SOURCE's files or a cluster's, which Python inputs cannot take."""
    if options.engine != "local":
        raise UsageError("Python inputs are pickled on this machine for its workers: build them with engine='local'")
    for name, value in (("label", options.label), ("include", options.include)):
        if value:
            raise UsageError(
                f"{name}= chooses among a SOURCE's files; Python inputs are all built (return the fields you want)"
            )
    if options.path_column != tables.FILE_NAME:
        raise UsageError("path_column= names a table's column of files; Python inputs are the items themselves")


def _spill_folder() -> str:
    """Where Python inputs are pickled for the workers: on this machine, removed when the build
    ends (swept by the next build should this one be killed)."""
    folder = tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-inputs-")
    atexit.register(shutil.rmtree, folder, True)
    return folder


def _make_folder(folder: Path) -> None:
    """OUTPUT's folder and those above it, as `mkdir -p` makes them."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot make OUTPUT's folder {folder}: {_os_error_text(exc)}") from None


def _os_error_text(exc: OSError) -> str:
    where = f" ({exc.filename})" if exc.filename else ""
    return f"{exc.strerror or exc}{where}"


def _check_store_reachable(paths: BuildPaths) -> None:
    """Fail early, in one line, when the store cannot be reached or the bucket is missing."""
    bucket = storage.fs_path(paths.url).split("/", 1)[0]
    try:
        paths.fs.ls(bucket, detail=False)  # unlike exists(), raises when the store cannot be reached
    except FileNotFoundError:
        raise UsageError(f"OUTPUT {paths.url}: no bucket {bucket!r} (or these credentials cannot see it).") from None
    except Exception as exc:  # noqa: BLE001 - the store's client raises many kinds
        raise BuildFailed(f"cannot reach {paths.url}: {describe_error(exc)}", BuildReport("", paths.url)) from None
