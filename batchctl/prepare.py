"""Before a build runs: read what its start is planned from, once each (`read_output`: the
dataset at OUTPUT; `read_interrupted`, `read_published`: the facts `batchctl.plan.start` decides
on), then set the work folder up as the plan says (`prepare`): keep what a resume keeps, or seed an
incremental build's staging dataset from the published one, or start an empty one.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from batchctl.errors import FormatError
from batchctl.plan.start import Interrupted, Published, Request, Seed, Start
from batchctl.run.staging import BuildPaths, Workdir
from batchctl.store import codec, metadata as meta, ragged, storage
from batchctl.store.digest import HASH_THREADS, hashes_by_shard, shard_problem
from batchctl.store.format import remove_shards_from
from batchctl.store.journal import GroupLine, Journaled, Untrusted, resolve
from batchctl.store.record import Record, read_record
from batchctl.store.shards import read_chunk
from batchctl.store.zarrmeta import ArrayMeta, DatasetFiles


@dataclass(frozen=True)
class Output:
    """The dataset at OUTPUT as this build finds it (once any half-done publish is recovered): its
    attributes and, when it is complete, its build info. Read once, for the up-to-date check and
    the start's plan."""

    attrs: meta.DatasetAttrs | None = None
    info: meta.BuildInfo | None = None

    @property
    def complete(self) -> bool:
        return self.attrs is not None and self.attrs.complete


def read_output(paths: BuildPaths) -> Output:
    attrs = meta.read_dataset_attrs(paths.url, paths.storage_options)
    if attrs is None or not attrs.complete:
        return Output(attrs)
    return Output(attrs, meta.read_build_info(paths.url, paths.storage_options))


def read_interrupted(paths: BuildPaths, work: Workdir, batch_size: int) -> Interrupted | None:
    """What an interrupted build left in the work folder, or None when there is none. Raises
    `Untrusted` for a `state.json` that is not batchctl's; a journal that is not is reported in
    the facts (the plan says whether it matters)."""
    state = work.read_state()
    if state is None:
        return None
    files = paths.staging_files
    arrays = files.arrays()
    try:
        journal = resolve(work.read_journal(batch_size), batch_size)
    except Untrusted as exc:
        return Interrupted(state, problem=str(exc))
    facts = Interrupted(state, journal, arrays=tuple(arrays))
    if state.engine == "local":
        facts = _local_facts(facts, paths, arrays)
    else:
        present = frozenset(g.group for g in journal.groups if _group_there(paths, files, arrays, journal, g))
        facts = replace(facts, groups_present=present)
    if state.incremental is not None:
        seeded = state.incremental
        try:
            record = read_record(paths.record_url, paths.storage_options, seeded.build_id, seeded.record_sha256)
        except Untrusted as exc:
            return replace(facts, record_problem=str(exc))
        return replace(facts, record=record)
    return facts


def _local_facts(facts: Interrupted, paths: BuildPaths, arrays: Mapping[str, ArrayMeta]) -> Interrupted:
    """The sizes of the shard files the journal's batches lie in (finished shards' too: a file
    cut short after its shard was journaled finished is seen), and whether its half-filled batch
    decodes."""
    journal = facts.journal
    shards = {batch.shard for batch in journal.kept}
    files = paths.staging_files
    sizes = {(name, shard): files.size(arr.shard_key(shard)) for name, arr in arrays.items() for shard in shards}
    decodes = journal.partial is not None and _decodes(paths, arrays, journal)
    return replace(facts, shard_sizes=sizes, partial_decodes=decodes)


def _decodes(paths: BuildPaths, arrays: Mapping[str, ArrayMeta], journal: Journaled) -> bool:
    """The half-filled batch reads back whole from its shard files (local OUTPUT only)."""
    partial = journal.partial
    if paths.remote or partial is None:
        return False
    try:
        for name, arr in arrays.items():
            stored = read_chunk(arr, partial.shard, paths.staging, partial.chunks[name])
            if ragged.is_values(arr):
                ragged.ValuesEncoder(arr).decode(stored, partial.chunks[name])
            else:
                codec.ChunkEncoder.for_array(arr).decode(stored)
    except (OSError, ValueError, RuntimeError, KeyError):  # FormatError is a ValueError
        return False
    return True


def _group_there(
    paths: BuildPaths, files: DatasetFiles, arrays: Mapping[str, ArrayMeta], journal: Journaled, line: GroupLine
) -> bool:
    """A finished Dask group's output is there: its shard (`full`) or its spill object."""
    if line.full:
        source = arrays.get(meta.SOURCE)
        return source is not None and files.size(source.shard_key(journal.done_shards + line.group)) >= 0
    spill_fs, where = storage.locate(paths.spill_url(line.group), paths.storage_options)
    return bool(spill_fs.exists(where))


def read_published(paths: BuildPaths, output: Output, keep_tail: bool) -> Published:
    """The dataset at OUTPUT (as `read_output` found it), its record (and why it is not used),
    and the chunks of its short last shard, which an incremental build may keep open."""
    attrs, info = output.attrs, output.info
    if attrs is None or not attrs.complete:
        return Published(attrs)
    if info is not None and info.digest != attrs.digest:
        info = None  # not this version's
    try:
        arrays = DatasetFiles(paths.url, paths.storage_options).arrays()
        record = _read_record(paths, attrs, info.record_sha256 if info else "")
        width = arrays[meta.SOURCE].shape[1] if record else 0
    except FormatError as exc:
        return Published(attrs, record_problem=str(exc))
    except (KeyError, IndexError):
        return Published(attrs, record_problem="the dataset has no source column")
    if record is None:
        return Published(attrs)
    try:
        tail = _tail_chunks(paths, arrays, record) if keep_tail else {}
    except (OSError, FormatError) as exc:
        return Published(attrs, record_problem=f"its last shard cannot be kept open ({exc})")
    hashes = hashes_by_shard(arrays, info.shards, attrs.num_shards) if info else {}  # not read again
    return Published(attrs, record, source_width=width, tail_chunks=tail, shard_hashes=hashes, arrays=arrays)


def damaged_shards(paths: BuildPaths, published: Published, shards: Collection[int]) -> dict[int, str]:
    """Which published `shards` (those an incremental build would keep) are not what the last
    build wrote, and why: each file's hash against the build info's where it has one (a local
    OUTPUT: the kept files are read once, in threads), else its index and size (an object store,
    whose objects are replaced whole, never edited in place; a dataset of an older batchctl)."""
    assert published.record is not None
    files, arrays = DatasetFiles(paths.url, paths.storage_options), published.arrays  # (read once, by read_published)
    checks = [
        (shard, name, None if paths.remote else published.shard_hashes.get(shard, {}).get(name))
        for shard in sorted(shards)
        for name in sorted(arrays)
    ]

    def problem(check: tuple[int, str, str | None]) -> str | None:
        shard, name, known = check
        return shard_problem(files, arrays[name].shard_key(shard), arrays[name].chunks_per_shard, known)

    found: dict[int, str] = {}
    with ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="batchctl-check") as pool:
        for (shard, name, _), why in zip(checks, pool.map(problem, checks), strict=True):
            if why is not None and shard not in found:
                found[shard] = f"{name}: {why}"
    return found


def _read_record(paths: BuildPaths, attrs: meta.DatasetAttrs, sha256: str) -> Record | None:
    """The dataset's record: inside it, or beside it for a dataset an earlier batchctl published
    (`sha256`, from the build info where there is one, vouches for it)."""
    for where in (paths.record_url, paths.old_record_url):
        found = read_record(where, paths.storage_options, attrs.build_id, sha256)
        if found is not None:
            return found
    return None


def _tail_chunks(
    paths: BuildPaths, arrays: Mapping[str, ArrayMeta], record: Record
) -> dict[str, tuple[tuple[int, ...], ...]]:
    """(offset, nbytes) of each chunk of the published last shard of every array, from its index,
    when that shard is short (local OUTPUT: only there is a shard kept open)."""
    last = record.batches[-1].shard if record.batches else -1
    rows = sum(batch.rows for batch in record.batches if batch.shard == last)
    if last < 0 or rows >= record.shard_rows or paths.remote:
        return {}
    found = {}
    for name, arr in arrays.items():
        path = paths.output / arr.shard_key(last)
        places: list[Any] = codec.read_shard_index(path, arr.chunks_per_shard)
        if ragged.is_values(arr):  # a batch's values span several chunks: its place is all of them
            places = ragged.batch_places(np.array(places, dtype=np.uint64), ragged.ValuesEncoder(arr), str(path))
        found[name] = tuple(tuple(int(n) for n in place) for place in places)
    return found


def prepare(
    start: Start,
    request: Request,
    paths: BuildPaths,
    work: Workdir,
    staging_attrs: meta.DatasetAttrs,
    interrupted: Interrupted | None,
    published: Published | None,
) -> None:
    """Set the work folder up as `start` says, from the facts it was planned on. A resume keeps its
    state and journal (cut to what it keeps) and drops the shard files past them; any other start
    empties the work folder, makes the staging dataset (`staging_attrs`: its attributes,
    `complete` false; an incremental build's from the published arrays) and writes the state last:
    a start cut short is simply made again."""
    if start.how == "resume":
        assert interrupted is not None
        if start.state.engine == "local":
            work.rewrite_journal(start.kept.lines())
            last = max((b.shard for b in start.kept.kept), default=-1)
            remove_shards_from(paths.staging_files, interrupted.arrays, last + 1)
        return
    work.start()
    if start.seed is None:
        meta.write_dataset_attrs(paths.staging_files, staging_attrs, new=True)
    else:
        assert published is not None
        _seed(paths, start.seed, request.carry_from, staging_attrs, published.arrays)
        work.append_journal(start.seed.lines)
    work.write_state(start.state)


def _seed(
    paths: BuildPaths, seed: Seed, carry_from: str, staging_attrs: meta.DatasetAttrs, arrays: Mapping[str, ArrayMeta]
) -> None:
    """The staging dataset an incremental build starts from: the published dataset's `arrays`
    (empty) and its kept shards renumbered 0..K-1. On an object store, where the dataset is
    changed in place, it is first marked incomplete and the shards whose rows are carried are
    copied aside (to `carry_from`)."""
    files = paths.staging_files
    if paths.remote:
        meta.write_dataset_attrs(files, staging_attrs)  # no longer complete: its shards move now
        fs, root = storage.locate(paths.url, paths.storage_options)
        _copy_metadata(files, DatasetFiles(carry_from, paths.storage_options), arrays)
        for shard in seed.carried_shards:
            _copy_shard(fs, arrays, f"{root}/", shard, f"{storage.fs_path(carry_from)}/", shard)
        for new, old in enumerate(seed.kept_shards):
            if new != old:
                _copy_shard(fs, arrays, f"{root}/", old, f"{root}/", new)
        remove_shards_from(files, arrays, len(seed.kept_shards))
        return
    published = DatasetFiles(paths.url)
    _copy_metadata(published, files, arrays)
    for new, old in enumerate(seed.kept_shards):
        for arr in arrays.values():
            source, target = paths.output / arr.shard_key(old), paths.staging / arr.shard_key(new)
            if new < seed.whole:
                _link(source, target)
            else:  # the open tail grows: a copy of its own, never a link to the published file
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, target)
    meta.write_dataset_attrs(files, staging_attrs)


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
