"""Build: plan a build (up to date? resume? start over?), run the pipeline, publish the dataset."""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import math
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict, Unpack

from batchctl.errors import (
    BuildFailed,
    BuildInterrupted,
    FormatError,
    PipelineError,
    ResumeMismatchError,
    Signalled,
    UsageError,
    check_signalled,
    signal_handled,
    signalled_in,
)
from batchctl.plan import incremental
from batchctl.plan.discover import Discovery, discover, hash_files
from batchctl.preprocess import Preprocessor, resolve
from batchctl.progress import ConsoleProgress, Progress
from batchctl.records import (
    Finished,
    Rejected,
    Task,
    TaskResult,
    WorkItem,
    describe_error,
)
from batchctl.report import BuildReport, Changes, FileError
from batchctl.run import staging
from batchctl.run.lock import BuildLock, LockUnavailable
from batchctl.run.mpinternals import semaphores_named_after
from batchctl.run.pipeline import Pipeline, PipelineConfig
from batchctl.run.processes import (
    leave_if_reimporting_main,
    refuse_main_children_cannot_run,
    signals_raise,
    start_forkserver,
    sweep_dead_builds,
)
from batchctl.run.staging import BuildPaths
from batchctl.run.writeplan import Carry, CollatorConfig, ResumePoint
from batchctl.store import metadata as meta, storage, zarrmeta
from batchctl.store.journal import Untrusted
from batchctl.store.storage import SourceRoot
from batchctl.store.zarrmeta import DatasetFiles
from batchctl.version import __version__

if TYPE_CHECKING:
    from batchctl.store.zarrmeta import ArrayMeta

# batchctl.store.format (numcodecs) is imported by the methods that encode or decode chunks, and
# zarr-python only where a dataset is read through it: a fresh build writes its `zarr.json`
# documents itself (`store.zarrmeta`), and a rerun that finds OUTPUT up to date reads them as JSON.

PART_BYTES = 16 * 2**20  # big files are split into parts of about this much input
WHOLE: tuple[None] = (None,)  # the one "part" of a file preprocessed whole


def default_workers() -> int:
    return len(os.sched_getaffinity(0))


@dataclass(frozen=True)
class BuildOptions:
    """Everything `batchctl build` takes besides SOURCE and OUTPUT."""

    batch_size: int = 64
    workers: int = field(default_factory=default_workers)
    preprocess: str = "image"
    preprocess_options: Mapping[str, Any] = field(default_factory=dict)
    seed: int | None = 0  # files are dispatched in this shuffled order; None: in sorted order
    shard_batches: int | None = None
    compression: str = "auto"
    max_errors: int | None = None
    resume: bool = True
    force: bool = False
    checksum: bool = False  # files are unchanged when their contents hash the same (else: size and mtime)
    timeout: float | None = None
    include: tuple[str, ...] = ()
    storage_options: Mapping[str, Any] = field(default_factory=dict)  # for a URL OUTPUT (fsspec)
    engine: str = "local"  # or "dask": a dask.distributed cluster preprocesses and writes shards
    scheduler: str | None = None  # the Dask scheduler's address; None starts a local cluster

    def __post_init__(self) -> None:
        if self.timeout is not None and not self.timeout > 0:
            raise UsageError(f"Expected timeout > 0 seconds, got {self.timeout!r} instead.")
        _positive("batch_size", self.batch_size)
        _positive("workers", self.workers)
        if self.shard_batches is not None:
            _positive("shard_batches", self.shard_batches)
        if self.max_errors is not None and self.max_errors < 0:
            raise UsageError(f"Expected max_errors >= 0, got {self.max_errors} instead.")
        if self.engine not in ("local", "dask"):
            raise UsageError(f"Expected engine local or dask, got {self.engine!r} instead.")
        if self.scheduler and self.engine != "dask":
            raise UsageError("--scheduler needs --engine dask.")
        try:
            meta.parse_compression(self.compression)
        except FormatError as exc:
            raise UsageError(str(exc)) from None


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise UsageError(f"Expected {name} to be a positive integer, got {value!r} instead.")


def dataset_spec(options: BuildOptions, preprocessor: Preprocessor, pp_options: Mapping[str, Any]) -> dict[str, Any]:
    """The options that decide what the dataset holds: a change to any of them means a rebuild."""
    return {
        "format_version": meta.FORMAT_VERSION,
        "batch_size": options.batch_size,
        "shard_batches": options.shard_batches,
        "compression": options.compression,
        "preprocess": {"name": preprocessor.name, "options": dict(pp_options), "code": preprocessor.code},
        "include": list(options.include),
    }


class BuildKwargs(TypedDict, total=False):
    """`build()`'s keyword arguments: every `batchctl build` option under its own name, with its
    meaning (`strict`, `sorted`, `resize`, `option`, `storage_option`, `report`, `quiet`, ...),
    and the fields of `BuildOptions` they come down to (`max_errors`, `preprocess_options`, ...).
    Tests keep both sets here."""

    batch_size: int
    workers: int
    preprocess: str
    preprocess_options: Mapping[str, object]
    seed: int | None
    shard_batches: int | None
    compression: str
    max_errors: int | None
    resume: bool
    force: bool
    checksum: bool
    timeout: float | None
    include: Sequence[str]
    storage_options: Mapping[str, object]
    engine: str
    scheduler: str | None
    # the CLI's own spellings
    strict: bool  # max_errors=0
    sorted: bool  # seed=None: files dispatched in path order
    resize: int
    crop: int
    layout: str
    sample_rate: int
    clip_seconds: float
    key: str
    split_rows: bool
    option: Mapping[str, object] | Sequence[str]  # preprocessor options: a dict, or "key=value" texts
    storage_option: Mapping[str, object] | Sequence[str]  # fsspec options: a dict, or "key=value" texts
    report: str | os.PathLike[str]  # the JSON report, written whatever the outcome
    quiet: bool  # print progress and the summary as the CLI does (False), or errors only (True)


PREPROCESS_FLAGS = ("resize", "crop", "layout", "sample_rate", "clip_seconds", "key", "split_rows")


def parse_option(text: str) -> tuple[str, Any]:
    """`key=value` with value read as JSON when it parses (numbers, true/false), else as text."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise UsageError(f"Expected --option key=value, got {text!r} instead.")
    try:
        return key, json.loads(raw)
    except ValueError:
        return key, raw


def build_options(**given: Any) -> BuildOptions:
    """`BuildOptions` from `build()`'s keywords (the CLI's names or the fields themselves)."""
    kwargs = dict(given)
    if kwargs.pop("strict", False):
        if kwargs.get("max_errors") not in (None, 0):
            raise UsageError(f"strict means max_errors=0; got max_errors={kwargs['max_errors']!r} too.")
        kwargs["max_errors"] = 0
    if kwargs.pop("sorted", False):
        kwargs["seed"] = None
    pp_options = dict(kwargs.pop("preprocess_options", None) or {})
    pp_options.update(_key_values(kwargs.pop("option", None), lambda text: dict([parse_option(text)])))
    for name in PREPROCESS_FLAGS:
        value = kwargs.pop(name, None)
        if value is not None and value is not False:
            pp_options[name] = value
    kwargs["preprocess_options"] = pp_options
    store = dict(kwargs.pop("storage_options", None) or {})
    store.update(_key_values(kwargs.pop("storage_option", None), lambda text: storage.parse_storage_options([text])))
    kwargs["storage_options"] = store
    kwargs["include"] = tuple(kwargs.get("include") or ())
    known = {f.name for f in dataclasses.fields(BuildOptions)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        names = sorted(known | set(BuildKwargs.__annotations__) - {"report", "quiet"})
        raise UsageError(f"build() takes no option {', '.join(unknown)}; its options are {', '.join(names)}.")
    return BuildOptions(**kwargs)


def _key_values(given: Any, parse: Callable[[str], Mapping[str, Any]]) -> dict[str, Any]:
    """A dict as it is, or "key=value" texts parsed one by one."""
    if given is None:
        return {}
    if isinstance(given, Mapping):
        return dict(given)
    found: dict[str, Any] = {}
    for text in [given] if isinstance(given, str) else given:
        found.update(parse(text))
    return found


def build(
    source: str | os.PathLike[str],
    output: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
    **options: Unpack[BuildKwargs],
) -> BuildReport:
    """Preprocess every file under `source` into the sharded dataset `output` (by default SOURCE's
    name plus `.zarr`, beside it). The options are `batchctl build`'s, as keywords of the same
    names (`BuildKwargs`).

    Returns the report of a complete (or already up-to-date) build; raises `BuildFailed` or
    `BuildInterrupted`, both carrying the report, when it ends otherwise.
    """
    leave_if_reimporting_main()
    given: dict[str, Any] = dict(options)
    report_path, quiet = given.pop("report", None), given.pop("quiet", None)
    opts = build_options(**given)
    if progress is None:
        progress = Progress() if quiet is None else ConsoleProgress(quiet=bool(quiet))
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
    def __init__(self, source: str, output: str, options: BuildOptions, progress: Progress) -> None:
        self.source, self.output, self.options, self.progress = source, output, options, progress
        resolved = resolve(options.preprocess)
        self.preprocessor = dataclasses.replace(resolved, include=tuple(options.include) or resolved.include)
        self.pp_options = self.preprocessor.options(options.preprocess_options)
        self.spec = dataset_spec(options, self.preprocessor, self.pp_options)
        self.paths = BuildPaths(output, options.storage_options)
        self.work = staging.workdir(self.paths)
        self.report = BuildReport(str(source), output)
        self.started = time.monotonic()
        self.new_samples = 0
        self.resumed_batches = 0  # batches kept from an interrupted run
        self.resume_point = ResumePoint([], None, 0)
        self.build_id = uuid.uuid4().hex
        self.digests: dict[str, str] = {}  # --checksum: each input's content hash
        self.carry: Carry | None = None  # an incremental build's rows carried over from the last one
        self.kept_groups: list[dict[str, Any]] = []  # --engine dask: groups an interrupted run finished

    def run(self) -> BuildReport:
        if storage.is_url(self.output):
            _check_store_reachable(self.paths)
        elif not self.paths.output.parent.is_dir():
            _make_folder(self.paths.output.parent)
        self.work.check()
        try:
            lock = BuildLock(self.paths.lock).acquire()
        except LockUnavailable:  # a folder this user cannot write: enough to say a dataset is up to date
            if not self.options.force and self._up_to_date(self._fingerprint(self._discover())):
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
        self._recover_publish()
        discovery = self._discover()
        fingerprint = self._fingerprint(discovery)
        if not self.options.force and self._up_to_date(fingerprint):
            return self._end("up_to_date")
        self.work.check_replaceable()
        if self.options.engine == "local":
            refuse_main_children_cannot_run()
            start_forkserver()  # there is work (the CLI started it already): its preloads run alongside our planning
        if not discovery.items:
            raise BuildFailed(
                f"nothing to build: no file under {self.source} is taken by the {self.preprocessor.name!r} "
                f"preprocessor ({', '.join(self.preprocessor.include or self.preprocessor.extensions or ('any',))})",
                self.report,
            )
        tasks = self._plan(discovery)
        check_signalled()
        for relpath, reason in discovery.unreadable:
            self._error(relpath, reason)
        if self.options.engine == "dask":
            return self._run_dask(discovery, fingerprint, tasks)
        split = any(task.part for task in tasks)
        self.progress.start(len(tasks), self.resumed_batches, split)
        config = PipelineConfig(
            self.preprocessor,
            self.pp_options,
            SourceRoot(self.source, self.options.storage_options),
            self.options.workers,
            self.options.timeout,
            paths=self.paths,
            collator=CollatorConfig(
                paths=self.paths,
                batch_size=self.options.batch_size,
                shard_batches=self.options.shard_batches,
                compression=self.options.compression,
                labelled=discovery.classes is not None,
                source_bytes=meta.source_width(item.relpath for item in discovery.items),
                resume=self.resume_point,
                carry=self.carry,
            ),
        )
        with semaphores_named_after(os.getpid()):  # what a SIGKILL of the whole group leaves, a later build sweeps
            finished = Pipeline(config, self.progress, self._on_result, self._on_rejected).run(tasks)
        self.progress.close()
        if finished.samples == 0:
            raise BuildFailed(f"no samples were produced: all {len(discovery.items)} files were skipped", self.report)
        return self._complete(discovery, fingerprint, finished)

    def _run_dask(self, discovery: Discovery, fingerprint: str, tasks: list[Task]) -> BuildReport:
        from batchctl.run.dask_engine import DaskJob, DaskRun

        self.progress.start(len(tasks), self.resumed_batches, any(task.part for task in tasks))
        job = DaskJob(
            paths=self.paths,
            source=SourceRoot(self.source, self.options.storage_options),
            preprocessor=self.preprocessor,
            pp_options=self.pp_options,
            batch_size=self.options.batch_size,
            shard_batches=self.options.shard_batches,
            compression=self.options.compression,
            workers=self.options.workers,
            scheduler=self.options.scheduler,
            labelled=discovery.classes is not None,
            source_bytes=meta.source_width(item.relpath for item in discovery.items),
            on_result=self._on_dask_result,
            on_batches=self.progress.batches_written,
            base=self.resume_point.done_shards,
            kept_groups=self.kept_groups,
            carry=self.carry,
        )
        run = DaskRun(job)
        finished = run.run(tasks)
        self.progress.close()
        self.report.workers_seen = sorted(run.workers_seen)
        if finished.samples == 0:
            raise BuildFailed(f"no samples were produced: all {len(discovery.items)} files were skipped", self.report)
        return self._complete(discovery, fingerprint, finished)

    def _on_dask_result(self, result: TaskResult) -> None:
        self._on_result(result)
        self.progress.files_done()

    def _complete(self, discovery: Discovery, fingerprint: str, finished: Finished) -> BuildReport:
        check_signalled()
        retry = {error.source for error in self.report.errors if error.retry}
        if retry:  # files lost with their worker: the next run must not find this dataset up to date
            fingerprint = discovery.fingerprint([self.spec, discovery.classes], leave_out=retry, digests=self.digests)
        self._publish(discovery, fingerprint, finished, self._record(discovery, finished))
        self.report.samples = finished.samples
        self.report.batches = meta.num_batches(finished.samples, self.options.batch_size)
        self.report.shards = finished.shards
        self.report.bytes = storage.tree_bytes(self.output, self.options.storage_options)
        return self._end("complete")

    def _discover(self) -> Discovery:
        discovery = discover(
            self.source, self.preprocessor.accepts, self.options.seed, self.options.storage_options, self.output
        )
        self.report.ignored, self.report.ignored_paths = discovery.ignored, discovery.ignored_paths
        return discovery

    def _fingerprint(self, discovery: Discovery) -> str:
        """What a dataset built from these files with these options says it was built from."""
        if self.options.checksum:
            self.digests = hash_files(self.source, discovery.items, self.options.storage_options, self.options.workers)
        return discovery.fingerprint([self.spec, discovery.classes], digests=self.digests)

    def _recover_publish(self) -> None:
        """A run killed while publishing: finish it, or drop its marker so the build resumes."""
        published = meta.read_dataset_attrs(self.output, self.options.storage_options)
        done = self.work.recover(published.build_id if published is not None and published.complete else None)
        if done:
            self.progress.info(done)

    def _up_to_date(self, fingerprint: str) -> bool:
        attrs = meta.read_dataset_attrs(self.output, self.options.storage_options)
        if attrs is None or not attrs.complete or attrs.fingerprint != fingerprint:
            return False
        self.report.samples, self.report.batches, self.report.shards = (
            attrs.num_samples,
            attrs.num_batches,
            attrs.num_shards,
        )
        self.report.bytes = storage.tree_bytes(self.output, self.options.storage_options)
        return True

    def _plan(self, discovery: Discovery) -> list[Task]:
        """Resume an interrupted build of the same options, else build on the last complete build
        (incrementally), else start a fresh staging dataset."""
        self.report.in_place = self.paths.remote  # from here on a URL OUTPUT is written in place
        if self.options.resume:
            try:
                tasks = self._resume_interrupted(discovery)
            except Untrusted as exc:
                raise Untrusted(
                    f"the interrupted build's work in {self.paths.workdir_url} is not what batchctl wrote ({exc}); "
                    "rerun with --no-resume to start over"
                ) from None
            if tasks is not None:
                return tasks
        found = self._incremental_plan(discovery)
        self.work.start()
        if found is not None:
            state = self._seed(discovery, *found)
            tasks = self._resume(discovery, state, found)
            if tasks is not None:
                return tasks
            self.work.start()
        meta.write_dataset_attrs(self.paths.staging_files, self._attrs(discovery), new=True)
        self.work.write_state(self._state(discovery))
        return self._tasks(discovery, {})

    def _resume_interrupted(self, discovery: Discovery) -> list[Task] | None:
        """The tasks left by an interrupted build of the same options, or None when there is none
        to resume (or it cannot be resumed)."""
        state = self.work.read_state()
        if state is None:
            return None
        if state.get("spec") != self.spec or state.get("source") != str(self.source):
            raise ResumeMismatchError(_mismatch_text(state, self.spec, str(self.source)))
        seeded = state.get("incremental")
        if seeded is not None and seeded["carry_from"] != self._carry_from:
            raise Untrusted(f"state.json: carry_from is {seeded['carry_from']!r}, not {self._carry_from!r}")
        return self._resume(discovery, state)

    @property
    def _carry_from(self) -> str:
        """Where an incremental build reads the rows it carries over: the published dataset, or
        on an object store (where the dataset changes in place) the copies of its shards."""
        return f"{self.paths.workdir_url}/previous.zarr" if self.paths.remote else self.output

    def _state(self, discovery: Discovery, **more: Any) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "source": str(self.source),
            "classes": discovery.classes,
            "engine": self.options.engine,
            **more,
        }

    def _incremental_plan(self, discovery: Discovery) -> tuple[incremental.Plan, incremental.Record] | None:
        """How to build on the complete dataset at OUTPUT, or None (and why, in one line) when
        everything must be built."""
        attrs = meta.read_dataset_attrs(self.output, self.options.storage_options)
        if attrs is None:  # a first build (or a dataset of another format version): nothing to build on
            return None
        if not attrs.complete:
            self.progress.info("building everything: the dataset at OUTPUT was left incomplete")
            return None
        if self.options.force:
            self.progress.info("building everything (--force)")
            return None
        try:
            record = self._read_record(attrs)
            if record is not None:
                width = DatasetFiles(self.output, self.options.storage_options).arrays()[meta.SOURCE].shape[1]
                incremental.check_fits(record, attrs, width)
        except (FormatError, KeyError, IndexError) as exc:
            why_not = str(exc) if isinstance(exc, FormatError) else "the dataset has no source column"
            self.progress.info(f"building everything: the record {self.paths.record_url} is not used: {why_not}")
            return None
        if record is None:
            self.progress.info("building everything: no record of which file each row of OUTPUT came from")
            return None
        why = _differences({**record.spec, "source": record.source}, {**self.spec, "source": str(self.source)})
        if record.classes != discovery.classes:
            why.append("the class folders changed")
        plan = incremental.plan(record, discovery.items, self.digests, self.options.checksum, self._keep_tail)
        longest = max((len(path.encode()) for path in plan.preprocess), default=0)
        if longest > record.source_width:
            why.append(f"a new path of {longest} bytes is longer than the source column's {record.source_width}")
        if why:
            self.progress.info("building everything: " + "; ".join(why))
            return None
        return plan, record

    def _read_record(self, attrs: meta.DatasetAttrs) -> incremental.Record | None:
        """The dataset's record: inside it, or beside it for a dataset an earlier batchctl published
        (its hash in the dataset's attributes vouches for it either way)."""
        for where in (self.paths.record_url, self.paths.old_record_url):
            found = incremental.read_record(where, self.options.storage_options, attrs.build_id, attrs.record_sha256)
            if found is not None:
                return found
        return None

    def _seed(self, discovery: Discovery, plan: incremental.Plan, record: incremental.Record) -> dict[str, Any]:
        """Make the staging dataset an incremental build starts from: the previous dataset's
        arrays (empty), its kept shards renumbered 0..K-1 and journaled as finished. Returns the
        state, written last: a seeding cut short is simply done again (or, on an object store,
        where it moves shards in place, the next run builds everything)."""
        from batchctl.store import format as fmt

        carry_from = self._carry_from
        files = self.paths.staging_files
        if self.paths.remote:
            # no longer complete, nor the build its record names: its shards move now
            meta.write_dataset_attrs(files, self._attrs(discovery))
            fs, root = storage.locate(self.output, self.options.storage_options)
            arrays = files.arrays()
            _copy_metadata(files, zarrmeta.DatasetFiles(carry_from, self.options.storage_options), arrays)
            for shard in sorted({r.shard for r in plan.carry}):
                _copy_shard(fs, arrays, f"{root}/", shard, f"{storage.fs_path(carry_from)}/", shard)
            for new, old in enumerate(plan.kept_shards):
                if new != old:
                    _copy_shard(fs, arrays, f"{root}/", old, f"{root}/", new)
            fmt.remove_shards_from(files, arrays, len(plan.kept_shards))
        else:
            published = zarrmeta.DatasetFiles(self.output)
            arrays = published.arrays()
            _copy_metadata(published, files, arrays)
            for new, old in enumerate(plan.kept_shards):
                for arr in arrays.values():
                    source, target = self.paths.output / arr.shard_key(old), self.paths.staging / arr.shard_key(new)
                    if new < len(plan.done_shards):
                        _link(source, target)
                    else:  # the open tail grows: a copy of its own, never a link to the published file
                        target.parent.mkdir(parents=True, exist_ok=True)
                        shutil.copyfile(source, target)
            meta.write_dataset_attrs(files, self._attrs(discovery))
        lines: list[dict[str, Any]] = []
        tail = len(plan.done_shards)
        chunks = self._tail_chunks(arrays, tail, record.shard_batches) if plan.open_tail else {}
        for batch in plan.kept_batches:
            position = int(batch["batch"]) % record.shard_batches
            if batch["shard"] == tail:  # the open tail: its chunks' places, read from its shard index
                lines.append({**batch, "chunks": {name: spots[position] for name, spots in chunks.items()}})
                continue
            lines.append({**batch, "chunks": {}})
            if position == record.shard_batches - 1:
                lines.append({"shard_done": batch["shard"]})
        if lines:
            self.work.append_journal(lines)
        state = self._state(
            discovery,
            incremental={
                "build_id": record.build_id,
                "record_sha256": record.sha256,
                "carry_from": carry_from,
                "kept_shards": len(plan.done_shards),
                "kept_samples": plan.kept_samples,
            },
        )
        self.work.write_state(state)
        return state

    @property
    def _keep_tail(self) -> bool:
        """An incremental build may keep the short last shard open and append to it: only the local
        engine's collator appends, and only to a local file (an object is written whole)."""
        return self.options.engine == "local" and not self.paths.remote

    def _tail_chunks(self, arrays: Mapping[str, ArrayMeta], shard: int, shard_batches: int) -> dict[str, list[Any]]:
        """(offset, nbytes) of each chunk of a copied shard file of each array, from its index."""
        from batchctl.store import codec

        return {
            name: codec.read_shard_index(self.paths.staging / arr.shard_key(shard), shard_batches)
            for name, arr in arrays.items()
        }

    def _resume(
        self,
        discovery: Discovery,
        state: Mapping[str, Any],
        seeded_from: tuple[incremental.Plan, incremental.Record] | None = None,
    ) -> list[Task] | None:
        """Tasks still to do after an interrupted run, or None when it cannot be trusted.
        `seeded_from`: the plan and record an incremental build just seeded the staging from (a
        resumed one reads the record again)."""
        if state.get("classes") != discovery.classes:
            self.progress.info("the class folders changed since the interrupted build; starting over")
            return None
        engine = state.get("engine", "local")
        if engine != self.options.engine:
            self.progress.info(f"the interrupted build ran on the {engine} engine; starting over")
            return None
        kept = self._journaled() if engine == "local" else self._journaled_groups()
        written: dict[tuple[str, int], list[Any]] = {}  # (file, first sample of part) -> count, finished, stamp
        for relpath, count, finished, size, mtime_ns, first in kept.entries:
            entry = written.setdefault((relpath, first), [0, False, size, mtime_ns])
            entry[0] += count
            entry[1] = entry[1] or finished
        current = {item.relpath: item for item in discovery.items}
        for (relpath, _), (_, _, size, mtime_ns) in written.items():
            item = current.get(relpath)
            if item is None or (item.size, item.mtime_ns) != (size, mtime_ns):
                self.progress.info(f"{relpath} changed or vanished since the interrupted build; starting over")
                return None
        only = None
        seeded = state.get("incremental")
        if seeded is not None:
            plan = self._carry_plan(discovery, seeded, written, seeded_from)
            if plan is None:
                return None
            only = plan.preprocess
        if engine == "local":
            self.work.rewrite_journal(kept.lines())
        self.resume_point = ResumePoint(kept.batches, kept.partial, kept.done_shards)
        self.kept_groups = kept.groups
        self.report.resumed_shards = kept.done_shards - (seeded or {}).get("kept_shards", 0)
        kept_samples = sum(int(entry[1]) for entry in kept.entries)
        self.report.resumed_samples = kept_samples - (seeded or {}).get("kept_samples", 0)
        if self.report.resumed_samples < 0:
            raise Untrusted(f"state.json: kept_samples is more than the {kept_samples} rows the journal keeps")
        self.resumed_batches = len(kept.batches)
        if self.report.resumed_samples:
            self.progress.info(f"resuming: {self.report.resumed_samples} samples kept from the interrupted build")
        return self._tasks(discovery, written, only)

    def _carry_plan(
        self,
        discovery: Discovery,
        seeded: Mapping[str, Any],
        written: Mapping[tuple[str, int], list[Any]],
        known: tuple[incremental.Plan, incremental.Record] | None,
    ) -> incremental.Plan | None:
        """An incremental build's plan (`known`, or made again from the record), and what of its
        carry is still to do."""
        if known is not None:
            plan, record = known
        else:
            try:
                loaded = incremental.read_record(
                    self.paths.record_url,
                    self.options.storage_options,
                    str(seeded["build_id"]),
                    str(seeded.get("record_sha256", "")),
                )
            except Untrusted as exc:
                self.progress.info(f"the record of the last build is not used ({exc}); starting over")
                return None
            if loaded is None:
                self.progress.info("the record of the last build is gone; starting over")
                return None
            record = loaded
            plan = incremental.plan(record, discovery.items, self.digests, self.options.checksum, self._keep_tail)
        done = {key: (int(entry[0]), bool(entry[1])) for key, entry in written.items()}
        runs = incremental.remaining_carry(plan.carry, done)
        self.carry = Carry(str(seeded["carry_from"]), dict(self.options.storage_options), record.shard_rows, runs)
        self.report.changes = Changes.of(plan.changes)
        self.report.kept_samples = int(seeded.get("kept_samples", 0)) + sum(run.rows for run in plan.carry)
        for relpath, (_, _, reason, retry) in plan.skipped.items():
            self.report.errors.append(FileError(relpath, str(reason), bool(retry)))
        self.progress.info(plan.changes.line())
        return plan

    def _journaled(self) -> staging.Journaled:
        """What the interrupted build journaled and is really there: batches whose chunks lie
        within their shard files (the journal is written after its data is fsynced, so this only
        cuts what a damaged disk lost), and a half-filled batch that still decodes. Shard files
        past the last kept batch's shard are deleted."""
        from batchctl.store import format as fmt

        arrays = self.paths.staging_files.arrays()
        if not arrays:
            return staging.Journaled([], None, 0)
        kept = staging.resolve_journal(self.work.read_journal(), self.options.batch_size)
        batches, partial = kept.batches, kept.partial
        files = self.paths.staging_files
        sizes: dict[str, int] = {}

        def present(batch: dict[str, Any]) -> bool:
            for name, arr in arrays.items():
                key = arr.shard_key(int(batch["shard"]))
                if key not in sizes:
                    sizes[key] = files.size(key)
                if name not in batch["chunks"]:
                    raise Untrusted(f"journal: batch {batch['batch']} has no chunk of {name!r}")
                offset, nbytes = batch["chunks"][name]
                if sizes[key] < offset + nbytes:
                    return False
            return True

        done = kept.done_shards
        cut = next((i for i, batch in enumerate(batches) if batch["shard"] >= done and not present(batch)), None)
        if cut is not None:
            batches, partial = batches[:cut], None
        if partial is not None and not self._decodes(arrays, partial):
            partial = None
        journaled = staging.Journaled(batches, partial, done)
        fmt.remove_shards_from(files, arrays, max((b["shard"] for b in journaled.kept), default=-1) + 1)
        return journaled

    def _journaled_groups(self) -> staging.Journaled:
        """What an interrupted Dask build journaled: the shards kept from the last build (finished
        shards) and the groups it finished whose shard or spill object is really there."""
        lines = self.work.read_journal()
        seeded = staging.resolve_journal(lines, self.options.batch_size)
        files = self.paths.staging_files
        source = files.arrays().get(meta.SOURCE)

        def present(line: dict[str, Any]) -> bool:
            if line["full"]:
                shard = seeded.done_shards + int(line["group"])
                return source is not None and files.size(source.shard_key(shard)) >= 0
            spill_fs, where = storage.locate(self.paths.spill_url(int(line["group"])), self.options.storage_options)
            return bool(spill_fs.exists(where))

        groups = [line for line in lines if "group" in line and present(line)]
        return staging.Journaled(seeded.batches, None, seeded.done_shards, groups)

    def _decodes(self, arrays: Mapping[str, ArrayMeta], partial: dict[str, Any]) -> bool:
        """The half-filled batch reads back whole from its shard files (local OUTPUT only)."""
        from batchctl.store import codec
        from batchctl.store.shards import read_chunk

        if self.paths.remote:
            return False
        try:
            for name, arr in arrays.items():
                chunk = tuple(int(v) for v in partial["chunks"][name])
                stored = read_chunk(arr, int(partial["shard"]), self.paths.staging, (chunk[0], chunk[1]))
                codec.ChunkEncoder.for_array(arr).decode(stored)
        except (OSError, ValueError, RuntimeError):  # FormatError is a ValueError
            return False
        return True

    def _tasks(
        self, discovery: Discovery, written: Mapping[tuple[str, int], list[Any]], only: set[str] | None = None
    ) -> list[Task]:
        """One task per file (of `only`, when given), or per part of a big file; what an
        interrupted run finished is left out and what it wrote of a part is skipped."""
        tasks: list[Task] = []
        splits = self.preprocessor.count is not None and not storage.is_url(self.source)
        for item in discovery.items:
            if only is not None and item.relpath not in only:
                continue
            for part in self._parts(item) if splits and item.size > PART_BYTES else WHOLE:
                count, finished = written.get((item.relpath, part[0] if part else 0), (0, False))[:2]
                if not finished:
                    tasks.append(Task(len(tasks), item, part, skip=count))
        return tasks

    def _parts(self, item: WorkItem) -> list[tuple[int, int] | None]:
        """Sample ranges of about PART_BYTES of input each, for a big file the preprocessor can count."""
        assert self.preprocessor.count is not None
        try:
            total = self.preprocessor.count(Path(self.source) / item.relpath, **self.pp_options)
        except Exception:  # noqa: BLE001 - the worker will meet the same problem and report it
            return [None]
        if not total or total < 2:
            return [None]
        per_part = max(1, math.ceil(total * PART_BYTES / item.size))
        return [(start, min(start + per_part, total)) for start in range(0, total, per_part)]

    def _record(self, discovery: Discovery, finished: Finished) -> incremental.Record:
        """The record of the dataset being published: its journal's batches (every row's file);
        for a Dask build, whose rows the client moved about, read from its `source` columns."""
        if self.options.engine == "local":
            batches = staging.resolve_journal(self.work.read_journal(), self.options.batch_size).batches
        else:
            batches = self._batches_from_columns({item.relpath: item for item in discovery.items})
        errors = {error.source: error for error in self.report.errors}
        skipped = {
            item.relpath: [item.size, item.mtime_ns, errors[item.relpath].error, errors[item.relpath].retry]
            for item in (discovery.items if errors else [])
            if item.relpath in errors
        }
        return incremental.Record(
            build_id=self.build_id,
            spec=self.spec,
            source=str(self.source),
            classes=discovery.classes,
            batch_size=self.options.batch_size,
            shard_batches=finished.shard_batches,
            source_width=self.paths.staging_files.arrays()[meta.SOURCE].shape[1],
            checksum=self.options.checksum,
            batches=batches,  # written without their chunks' places (`incremental.record_bytes`)
            skipped=skipped,
            digests=self.digests,
        )

    def _batches_from_columns(self, stamps: Mapping[str, WorkItem]) -> list[dict[str, Any]]:
        """Journal-like batch lines of the staging dataset, from its `source` and `source_index`:
        one entry per run of consecutive samples of one file within a batch."""
        import numpy as np
        import zarr

        from batchctl.store import format as fmt

        group = zarr.open_group(self.paths.staging_url, mode="r", **self.paths.zarr_kwargs())
        arrays = dict(group.arrays())
        sources = fmt.decode_sources(np.asarray(arrays[meta.SOURCE][:])).tolist()
        indices = np.asarray(arrays[meta.SOURCE_INDEX][:]).tolist()
        size = self.options.batch_size
        shard_rows = self.paths.staging_files.arrays()[meta.SOURCE].grid[0]
        batches = []
        for number, start in enumerate(range(0, len(sources), size)):
            files: list[list[Any]] = []
            for relpath, index in zip(sources[start : start + size], indices[start : start + size], strict=True):
                if files and files[-1][0] == relpath and files[-1][5] + files[-1][1] == index:
                    files[-1][1] += 1
                else:
                    item = stamps[relpath]
                    files.append([relpath, 1, True, item.size, item.mtime_ns, index])
            rows = min(size, len(sources) - start)
            batches.append({"batch": number, "shard": start // shard_rows, "rows": rows, "files": files})
        return batches

    def _on_result(self, result: TaskResult) -> None:
        if result.task.first == 0:
            self.report.processed += 1  # files, not parts: a file's first part counts it
        self.new_samples += result.samples
        if result.error is not None:
            self._error(result.task.item.relpath, result.error, retry=result.transient)

    def _on_rejected(self, event: Rejected) -> None:
        self.new_samples -= event.samples
        self._error(event.source, event.error)

    def _error(self, relpath: str, reason: str, retry: bool = False) -> None:
        self.report.errors.append(FileError(relpath, reason, retry))
        self.progress.error(relpath, reason)
        limit = self.options.max_errors
        if limit == 0:
            raise BuildFailed(f"{relpath} was skipped ({reason}); --strict (--max-errors 0) allows none", self.report)
        if limit is not None and len(self.report.errors) > limit:
            raise BuildFailed(f"more than {limit} files were skipped with errors (--max-errors {limit})", self.report)

    def _attrs(
        self, discovery: Discovery, fingerprint: str = "", finished: Finished | None = None
    ) -> meta.DatasetAttrs:
        """The group attributes: of a complete dataset once the collator `finished`, else of the
        staging dataset, `complete` false."""
        samples = finished.samples if finished else 0
        return meta.DatasetAttrs(
            batch_size=self.options.batch_size,
            shard_batches=finished.shard_batches if finished else self.options.shard_batches or 0,
            fields=finished.schema if finished else {},
            classes=discovery.classes,
            preprocess=self.spec["preprocess"],
            compression=self.options.compression,
            batchctl_version=__version__,
            created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            source=str(self.source),
            fingerprint=fingerprint,
            build_id=self.build_id,
            complete=finished is not None,
            num_samples=samples,
            num_batches=meta.num_batches(samples, self.options.batch_size),
            num_shards=finished.shards if finished else 0,
            errors=len(self.report.errors),
            ignored=discovery.ignored,
            ignored_paths=discovery.ignored_paths,
            skipped=[[error.source, error.error] for error in self.report.errors[: meta.MAX_SKIPPED_LISTED]],
        )

    def _publish(self, discovery: Discovery, fingerprint: str, finished: Finished, record: incremental.Record) -> None:
        """Mark the staging dataset complete (its last write, naming its record's hash), then move
        it and its record into place."""
        raw = incremental.record_bytes(record)
        attrs = self._attrs(discovery, fingerprint, finished)
        attrs.record_sha256 = hashlib.sha256(raw).hexdigest()
        notes = self.preprocessor.describe(self.pp_options) if self.preprocessor.describe else {}

        def mark_complete() -> None:
            arrays = meta.describe_arrays(self.paths.staging_files, discovery.classes, notes)
            meta.write_dataset_attrs(self.paths.staging_files, attrs, arrays=arrays)  # consolidates them

        self.work.publish(raw, self.build_id, mark_complete)
        for warning in self.work.warnings:
            self.progress.info(warning)

    def _end(self, status: Any, message: str = "") -> BuildReport:
        self.progress.close()
        self.report.status = status
        self.report.message = message
        self.report.elapsed_s = round(time.monotonic() - self.started, 3)
        self.report.samples_per_s = round(self.new_samples / max(self.report.elapsed_s, 1e-9), 1)
        if status in ("interrupted", "failed"):
            self.report.samples = self.new_samples
        return self.report


def _make_folder(folder: Path) -> None:
    """OUTPUT's folder and those above it, as `mkdir -p` makes them."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot make OUTPUT's folder {folder}: {_os_error_text(exc)}") from None


def _differences(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
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


def _mismatch_text(state: Mapping[str, Any], spec: Mapping[str, Any], source: str) -> str:
    diffs = _differences({**state.get("spec", {}), "source": state.get("source")}, {**spec, "source": source})
    return (
        "an interrupted build of this output used other options ("
        + "; ".join(diffs)
        + "): rerun with the same options to resume, or pass --no-resume to start over"
    )


def _copy_metadata(source: DatasetFiles, dest: DatasetFiles, arrays: Mapping[str, ArrayMeta]) -> None:
    """Copy the group's and `arrays`' `zarr.json` documents: with the shards copied too, `dest`
    reads them as `source` did."""
    for key in ["zarr.json", *(f"{name}/zarr.json" for name in arrays)]:
        dest.write(key, [source.read(key)])


def _copy_shard(fs: Any, arrays: Mapping[str, ArrayMeta], src: str, old: int, dest: str, new: int) -> None:
    """Copy shard `old` of every array to shard `new` (server-side on an object store)."""
    for arr in arrays.values():
        target = dest + arr.shard_key(new)
        fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        fs.copy(src + arr.shard_key(old), target)


def _link(src: Path, dst: Path) -> None:
    """A kept shard file in the staging dataset: a hard link to the published one (which is never
    written again), or a copy where the filesystem has no hard links."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


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
