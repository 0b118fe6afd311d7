"""Reading a dataset at a URL (any fsspec filesystem): a stored batch of a field is one ranged
read of exactly its bytes, found through its shard's index, itself one suffix-range read fetched
once and kept (a shard whose chunks are small, labels or sources, is fetched whole with its
first batch and kept: one request, not one per batch). A batch's fields (and the indexes it
needs) are fetched together, concurrently on an async filesystem (s3, gcs, azure), and the loader
keeps many batches in flight, so a reader waits on bandwidth rather than on one request's
latency. What is fetched may be kept in a bounded local cache (`ChunkCache`); a read that fails
for a passing reason (a reset connection, a 5xx, throttling, a store restarting) is retried with
backoff for a bounded time."""

from __future__ import annotations

import errno
import functools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import numpy as np

from batchctl.errors import FormatError
from batchctl.records import describe_error
from batchctl.store import ragged, storage
from batchctl.store.cache import ChunkCache
from batchctl.store.chunkread import ChunkLayout, ValuesLayout, row_views
from batchctl.store.codec import NO_CHUNK, own_codecs, parse_shard_index
from batchctl.store.storage import StoreError
from batchctl.store.zarrmeta import ArrayMeta

T = TypeVar("T")

RETRY_FOR_S = 60.0  # a read failing for a passing reason is retried this long before the epoch ends
ATTEMPT_TIMEOUT_S = 30.0  # one attempt (one batch's ranged reads together) gives up after this long
_FIRST_BACKOFF_S, _MAX_BACKOFF_S = 0.1, 5.0
# A shard whose chunks take at most this many bytes (labels, sources) is fetched whole with its
# first batch and kept: one request for its batches, where a request costs its latency, not its bytes
SMALL_SHARD_BYTES = 256 * 1024
_SMALL_SHARDS_KEPT = 64  # per array: at most 16 MiB
# what a retry cannot mend: a missing object, a refusal, a client's own failure (any other error,
# a reset connection, a 5xx, throttling, a timeout, is taken to pass: each store's client has its own kinds)
_LASTING = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    RuntimeError,
    TypeError,
    ValueError,
)


def _passing(error: BaseException) -> bool:
    """Whether a read that failed with `error` may succeed if tried again."""
    cause = error.__context__ if isinstance(error, StoreError) and error.__context__ is not None else error
    return not isinstance(cause, _LASTING)


@dataclass(frozen=True)
class Range:
    """Bytes of one object: `start` to `end`, or the last -`start` bytes when `end` is None."""

    path: str
    start: int
    end: int | None
    key: str  # its name in the cache


class RemoteStore:
    """The objects of one dataset version at a URL, read range by range."""

    def __init__(
        self, url: str, storage_options: Mapping[str, Any], cache: ChunkCache | None, retry_for: float = RETRY_FOR_S
    ) -> None:
        self.url, self.storage_options, self.cache, self.retry_for = url, storage_options, cache, retry_for
        self.root = storage.fs_path(url).rstrip("/")
        self._failing_since: float | None = None  # when the store stopped answering (monotonic)
        self._in_flight: dict[str, Future[bytes]] = {}  # a range one thread fetches, the others wait for
        self._lock = threading.Lock()
        self._repairing = threading.Lock()

    def fetch(self, ranges: list[Range], cached: bool = True) -> list[tuple[bytes, bool]]:
        """Each range's bytes, and whether they came from the cache. The others are fetched
        together (one concurrent call; a range another thread is fetching is waited for, not
        fetched twice), kept in the cache, and retried while they fail for a passing reason, up
        to `retry_for` seconds."""
        found = [self.cache.get(r.key) if self.cache is not None and cached else None for r in ranges]
        missing = [i for i, data in enumerate(found) if data is None]
        mine, theirs = [], []  # what this call fetches; what another thread is fetching already
        with self._lock:
            for i in missing:
                pending = self._in_flight.get(ranges[i].key)
                if pending is None:
                    pending = self._in_flight[ranges[i].key] = Future()
                    mine.append((i, pending))
                else:
                    theirs.append((i, pending))
        try:
            if self.cache is not None and cached:
                # cached by a thread whose fetch ended between this one's look and its claim
                for i, pending in mine:
                    if (data := self.cache.get(ranges[i].key)) is not None:
                        found[i] = data
                        missing.remove(i)
                        pending.set_result(data)
            fetch = [(i, pending) for i, pending in mine if not pending.done()]
            fetched = self._fetch_retrying([ranges[i] for i, _ in fetch]) if fetch else []
            for (i, pending), data in zip(fetch, fetched, strict=True):
                found[i] = data
                if self.cache is not None:
                    self.cache.put(ranges[i].key, data)
                pending.set_result(data)
        except BaseException as exc:
            for _, pending in mine:
                if not pending.done():
                    pending.set_exception(exc)
            raise
        finally:
            with self._lock:
                for i, _ in mine:
                    del self._in_flight[ranges[i].key]
        for i, pending in theirs:
            found[i] = pending.result()
        missed = set(missing)
        return [(cast(bytes, data), i not in missed) for i, data in enumerate(found)]

    def _fetch_retrying(self, ranges: list[Range]) -> list[bytes]:
        """The ranges' bytes, tried again while they fail for a passing reason. The time left to
        retry is the store's, not the call's: it runs from the start of the first failed
        attempt since the store last answered, so the loader's reads in flight give up together."""
        results: list[bytes | None] = [None] * len(ranges)
        pending = list(range(len(ranges)))
        backoff = _FIRST_BACKOFF_S
        while True:
            started = time.monotonic()
            failures = []
            for i, got in zip(pending, self._attempt([ranges[i] for i in pending]), strict=True):
                if isinstance(got, BaseException):
                    failures.append((i, got))
                else:
                    results[i] = got
            if not failures:
                self._failing_since = None
                return [r for r in results if r is not None]
            i, error = failures[0]
            if not _passing(error):
                raise self._failed(ranges[i], error)
            with self._lock:
                self._failing_since = self._failing_since or started
                deadline = self._failing_since + self.retry_for
            now = time.monotonic()
            if now >= deadline:
                what = f"no answer for {self.retry_for:g} s reading {ranges[i].path}"
                raise StoreError(errno.EIO, f"{self.url}: {what} ({describe_error(error)})")
            time.sleep(min(backoff, deadline - now))
            backoff = min(backoff * 2, _MAX_BACKOFF_S)
            pending = [i for i, _ in failures]

    def _attempt(self, ranges: list[Range]) -> list[bytes | BaseException]:
        """One try at every range together; a failure of the whole call is every range's."""
        # an async filesystem's call is cancelled after the timeout; a sync one has its own
        fs = storage.filesystem(self.url, self.storage_options)  # this process's (a DataLoader worker's)
        timeout = {"timeout": max(1.0, min(ATTEMPT_TIMEOUT_S, self.retry_for))} if fs.async_impl else {}
        try:
            paths, starts, ends = [r.path for r in ranges], [r.start for r in ranges], [r.end for r in ranges]
            got = fs.cat_ranges(paths, starts, ends, on_error="return", **timeout)
        except Exception as exc:  # noqa: BLE001 - each store's client raises its own kinds
            return [exc] * len(ranges)
        return [g if isinstance(g, BaseException) else bytes(g) for g in got]

    def _failed(self, where: Range, error: BaseException) -> Exception:
        if isinstance(error, FileNotFoundError):
            return FormatError(f"{self.url}: {where.path} is missing (damaged, or rebuilt since it was opened)")
        return StoreError(errno.EIO, f"{self.url}: reading {where.path} failed ({describe_error(error)})")

    def read_chunks(self, chunk: int, jobs: list[tuple[RemoteChunkReader, list[np.ndarray]]]) -> None:
        """Chunk `chunk` of several arrays into their row buffers: the shard indexes not yet
        known fetched together first, then every chunk together. A cached index or chunk that
        fails its checksum is dropped from the cache and fetched again."""
        self.load_indexes(chunk // jobs[0][0].per_shard, [reader for reader, _ in jobs])
        ranges = [reader.chunk_range(chunk) for reader, _ in jobs]
        held = [reader.held_span(chunk) for reader, _ in jobs]
        fetched = iter(self.fetch([where for where, span in zip(ranges, held, strict=True) if span is None]))
        for (reader, rows), where, span in zip(jobs, ranges, held, strict=True):
            # a kept span may have come from the cache: checked, and fetched again, the same way
            got = next(fetched) if span is None else (span, True)
            self.checked(where, got, functools.partial(reader.decode, chunk, where, rows=rows))

    def load_indexes(self, shard: int, readers: list[RemoteChunkReader]) -> None:
        """Shard `shard`'s index of each array not yet known, fetched together."""
        unknown = [reader for reader in readers if shard not in reader.indexes]
        for reader, got in zip(unknown, self.fetch([r.index_range(shard) for r in unknown]), strict=True):
            self.checked(reader.index_range(shard), got, functools.partial(reader.keep_index, shard))

    def checked(self, where: Range, got: tuple[bytes, bool], use: Callable[[bytes], T]) -> T:
        """`use` the bytes of `where` (what `fetch` got), and what it gives; those from the local
        cache once more from the store if they fail their checks there."""
        data, from_cache = got
        try:
            return use(data)
        except FormatError:
            if not from_cache or self.cache is None:
                raise
            return use(self._repaired(where, data))

    def _repaired(self, where: Range, damaged: bytes) -> bytes:
        """The store's copy of a range whose cached copy is damaged, cached in its place: fetched
        once, whichever of the threads that read the damaged copy comes first (repairs are rare:
        one at a time; a later one finds the cache holding other bytes, and takes those)."""
        assert self.cache is not None
        with self._repairing:
            current = self.cache.get(where.key)
            if current is not None and current != damaged:
                return current
            self.cache.discard(where.key)
            return self.fetch([where], cached=False)[0][0]


class RemoteChunkReader(ChunkLayout):
    """One array of a dataset at a URL, read chunk by chunk through its `RemoteStore`: the bytes
    come from ranged reads, everything else (index, checks, decoding) is `ChunkLayout`'s, as for
    a local file."""

    def __init__(self, store: RemoteStore, arr: ArrayMeta, inner: list[dict[str, Any]]) -> None:
        super().__init__(arr, inner)
        self.store = store
        self.indexes: dict[int, np.ndarray] = {}  # shard -> its index, kept once fetched
        self.small: dict[int, tuple[int, int]] = {}  # shard -> the span of its chunks, where small
        self._spans: OrderedDict[int, bytes] = OrderedDict()  # small shards' chunks, the last used kept
        self._lock = threading.Lock()

    @classmethod
    def for_array(cls, store: RemoteStore, arr: ArrayMeta) -> RemoteChunkReader | None:
        inner = own_codecs(arr)
        return None if inner is None else cls(store, arr, inner)

    def _path(self, shard: int) -> str:
        return f"{self.store.root}/{self.arr.shard_key(shard)}"

    def index_range(self, shard: int) -> Range:
        return Range(self._path(shard), -self.index_bytes, None, f"{self.arr.name}/index/{shard}")

    def keep_index(self, shard: int, raw: bytes) -> None:
        index = self.parse_index(raw, shard)
        present = index[index[:, 0] != NO_CHUNK]
        if len(present):
            start, end = int(present[:, 0].min()), int((present[:, 0] + present[:, 1]).max())
            if end - start <= SMALL_SHARD_BYTES:
                self.small[shard] = (start, end)
        self.indexes[shard] = index

    def _chunk_at(self, chunk: int) -> tuple[int, int, int]:
        """Chunk `chunk`'s shard, offset and size in it (its shard's index known)."""
        shard = chunk // self.per_shard
        return (shard, *self.locate(self.indexes[shard], chunk))

    def chunk_range(self, chunk: int) -> Range:
        """What to fetch for chunk `chunk`: its bytes, or, in a small shard, every chunk's (kept)."""
        shard, offset, nbytes = self._chunk_at(chunk)
        if shard in self.small:
            start, end = self.small[shard]
            return Range(self._path(shard), start, end, f"{self.arr.name}/chunks/{shard}")
        return Range(self._path(shard), offset, offset + nbytes, f"{self.arr.name}/{chunk}")

    def held_span(self, chunk: int) -> bytes | None:
        """The kept chunks of chunk `chunk`'s small shard, if fetched already."""
        with self._lock:
            held = self._spans.get(chunk // self.per_shard)
            if held is not None:
                self._spans.move_to_end(chunk // self.per_shard)
        return held

    def decode(self, chunk: int, where: Range, data: bytes, rows: list[np.ndarray]) -> None:
        """Chunk `chunk` into `rows` (C-contiguous buffers laid end to end) from `data`, the bytes
        of `where` (its `chunk_range`); a small shard's chunks are kept for its other batches."""
        views = row_views(rows, self.chunk_bytes)
        shard, offset, nbytes = self._chunk_at(chunk)
        if len(data) != cast(int, where.end) - where.start:
            raise FormatError(f"{self.where(chunk)}: the shard object is truncated")
        self.decode_into(chunk, memoryview(data)[offset - where.start : offset - where.start + nbytes], views)
        if shard in self.small:
            with self._lock:
                self._spans[shard] = data
                while len(self._spans) > _SMALL_SHARDS_KEPT:
                    self._spans.popitem(last=False)


class RemoteValuesReader(ValuesLayout):
    """A ragged field's values of a dataset at a URL, batch by batch: its shard's index fetched
    once, then the batch's chunks by one ranged read (through the store: its retries, in-flight
    sharing and cache). A missing shard or chunk is an error naming it, never the fill values a
    generic Zarr reader would give."""

    holder = "object"

    def __init__(self, store: RemoteStore, arr: ArrayMeta) -> None:
        super().__init__(arr)
        self.store = store
        self.indexes: dict[int, np.ndarray] = {}  # shard -> its index, kept once fetched

    @classmethod
    def for_array(cls, store: RemoteStore, arr: ArrayMeta) -> RemoteValuesReader | None:
        return cls(store, arr) if ragged.is_values(arr) and ragged.own_layout(arr) else None

    def _path(self, shard: int) -> str:
        return f"{self.store.root}/{self.arr.shard_key(shard)}"

    def read(self, batch: int) -> np.ndarray:
        """Batch `batch`'s values, laid end to end (its last chunk's padding included)."""
        shard = batch // self.per_shard
        where = f"{self.store.url}: {self.where(batch)}"
        place = self.place(self._index(shard, where), batch, where)
        if not place[1]:
            return self.decode(b"", place, where)
        span = Range(self._path(shard), place[0], place[0] + place[1], f"{self.arr.name}/{batch}")
        return self.store.checked(span, self.store.fetch([span])[0], lambda data: self.decode(data, place, where))

    def _index(self, shard: int, where: str) -> np.ndarray:
        """Shard `shard`'s index (checked against its crc32c), fetched once (threads may both)."""
        index = self.indexes.get(shard)
        if index is None:
            span = Range(self._path(shard), -(self.positions * 16 + 4), None, f"{self.arr.name}/index/{shard}")
            got = self.store.fetch([span])[0]
            index = self.indexes[shard] = self.store.checked(
                span, got, lambda raw: parse_shard_index(raw, self.positions, where)
            )
        return index
