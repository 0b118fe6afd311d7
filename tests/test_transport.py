"""The machinery between the stages: the shared-memory sample ring, the worker slots and
batchctl's own shard encoder."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zarr

import batchctl
from batchctl.records import Task, TaskOutput, WorkItem
from batchctl.run.processes import mp_context
from batchctl.run.ring import SampleRing
from batchctl.run.rows import provenance, runs_of
from batchctl.run.workers import WorkerSlots
from batchctl.store import chunkread, format as fmt, metadata, zarrmeta


def output(rows: int, seed: int, name: str = "x") -> TaskOutput:
    rng = np.random.default_rng(seed)
    task = Task(seed, WorkItem(f"f{seed}.npy", 0, 1, 0))
    return TaskOutput([(task.sent(), rows)], {name: rng.random((rows, 3, 5), dtype=np.float32), "n": np.arange(rows)})


@pytest.fixture
def ring() -> Iterator[SampleRing]:
    made = SampleRing.create(mp_context(), 3)
    assert made is not None  # Linux has memfd
    yield made
    made.close()


def test_ring_carries_outputs_exactly(ring: SampleRing) -> None:
    sent = [output(7, 1), output(2, 2, name="y")]
    message = ring.put(1, sent)
    assert message is not None and message.slot in (2, 3)  # worker slot 1's pair
    received = ring.outputs(message)
    assert [out.parts for out in received] == [out.parts for out in sent]
    for got, want in zip(received, sent, strict=True):
        assert got.columns.keys() == want.columns.keys()
        for name in want.columns:
            assert got.columns[name].dtype == want.columns[name].dtype
            assert np.array_equal(got.columns[name], want.columns[name])
    del received, got
    ring.release(message)
    assert ring.put(1, [output(3, 3)]) is not None  # the slot is free again


def test_a_chunk_kept_in_its_slot_leaves_the_worker_the_other_one(ring: SampleRing) -> None:
    """The collator may keep an early chunk in its ring slot while the worker's other slot is
    free: the worker's next chunks then go to that other slot, never waiting on the kept one."""
    kept = ring.put(0, [output(1, 2)])
    assert kept is not None and kept.slot in (0, 1) and ring.other_free(kept.slot)
    for seed in (2, 3, 4):  # each placed (released) at once: all in the other slot
        sent = ring.put(0, [output(seed, 2)])
        assert sent is not None and sent.slot == kept.slot ^ 1
        assert not ring.other_free(kept.slot)  # while the collator copies or places it
        ring.release(sent)
    assert ring.other_free(kept.slot)
    done = threading.Event()
    taken: list[int] = []

    def worker() -> None:  # both slots taken: it waits for the one it sent in last, not the kept one
        again = ring.put(0, [output(6, 2)])
        taken.append(-1 if again is None else again.slot)
        done.set()

    busy = ring.put(0, [output(5, 2)])
    assert busy is not None and busy.slot == kept.slot ^ 1
    thread = threading.Thread(target=worker)
    thread.start()
    assert not done.wait(0.2)  # the kept chunk is still held
    ring.release(busy)
    thread.join(10)
    assert taken == [kept.slot ^ 1]
    got = ring.outputs(kept)[0].columns["x"]  # the kept chunk is intact
    assert np.array_equal(got, output(1, 2).columns["x"])
    del got
    ring.release(kept)


def test_ring_refuses_what_does_not_fit(ring: SampleRing) -> None:
    big = TaskOutput([(Task(0, WorkItem("big", 0, 1, 0)).sent(), 1)], {"x": np.zeros(ring.slot_bytes + 1, np.uint8)})
    assert ring.put(0, [big]) is None
    objects = TaskOutput([(Task(0, WorkItem("o", 0, 1, 0)).sent(), 1)], {"x": np.array([{"a": 1}], dtype=object)})
    assert ring.put(0, [objects]) is None


def test_each_row_is_placed_with_its_file_sample_number_and_label() -> None:
    """What the collator stores beside each row, for one-sample files, a part of a big file and
    a part an interrupted run half wrote (its first `skip` samples are not sent again)."""
    whole = Task(0, WorkItem("a.npy", 2, 1, 0))
    part = Task(1, WorkItem("big.npy", 0, 1, 0), part=(100, 104))
    resumed = Task(2, WorkItem("big.npy", 0, 1, 0), part=(104, 110), skip=3)
    other = Task(3, WorkItem("b.npy", 1, 1, 0))
    parts = [(whole.sent(), 1), (part.sent(), 4), (resumed.sent(), 3), (other.sent(), 1)]
    index, labels, sources = provenance(runs_of(TaskOutput(parts, {"x": np.zeros(9)})))
    assert index.tolist() == [0, 100, 101, 102, 103, 107, 108, 109, 0]
    assert labels.tolist() == [2, 0, 0, 0, 0, 0, 0, 0, 1]
    assert sources == ["a.npy"] + ["big.npy"] * 7 + ["b.npy"]
    singles = [(whole.sent(), 1), (other.sent(), 1)]  # a row each: the shortcut
    index, labels, sources = provenance(runs_of(TaskOutput(singles, {"x": np.zeros(2)})))
    assert (index.tolist(), labels.tolist(), sources) == ([0, 0], [2, 1], ["a.npy", "b.npy"])


def test_a_dead_workers_ring_slot_is_retired() -> None:
    slots = WorkerSlots(mp_context(), 2)
    first = slots.claim(111)
    assert slots.ring_usable(first)
    slots.begin(first, 5)
    assert slots.release(111) == 5
    assert not slots.ring_usable(first)  # it may have died holding its ring slot
    assert slots.claim(222) != first  # a fresh worker gets a usable slot while there is one
    assert slots.claim(333) == first and not slots.ring_usable(first)  # then the retired one: the pipe


def sized(
    files: zarrmeta.DatasetFiles, arrays: dict[str, zarrmeta.ArrayMeta], rows: int
) -> dict[str, zarrmeta.ArrayMeta]:
    """The arrays `rows` long, their documents rewritten (as the collator does once it is done)."""
    resized = {name: arr.resized(rows) for name, arr in arrays.items()}
    for arr in resized.values():
        files.write_array(arr)
    return resized


@pytest.mark.parametrize("compression", metadata.COMPRESSIONS)
def test_shards_written_by_batchctl_read_back_in_zarr(tmp_path: Path, compression: str) -> None:
    files = zarrmeta.DatasetFiles(str(tmp_path / "d.zarr"))
    files.create_group({"note": "made by batchctl"})
    schema = {
        "x": metadata.FieldSpec((3, 5), "float32"),
        "y": metadata.FieldSpec((), "uint8"),
        "ok": metadata.FieldSpec((2,), "bool"),
    }
    layout = metadata.Layout(batch_size=4, shard_batches=3)
    rows = 2 * layout.shard_rows + 7  # a short last shard with a short last chunk
    rng = np.random.default_rng(0)
    columns = {
        "x": rng.random((rows, 3, 5), dtype=np.float32),
        "y": rng.integers(0, 255, rows).astype(np.uint8),
        "ok": rng.random((rows, 2)) > 0.5,
        metadata.LABEL: rng.integers(0, 3, rows),
        metadata.SOURCE_INDEX: np.arange(rows) * 3,
        metadata.SOURCE: np.array([f"é{i}" if i < 10 else f"s{i}" for i in range(rows)], dtype=object),
    }
    created = fmt.create_arrays(files, schema, layout, compression, True, 3, {n: c[:4] for n, c in columns.items()})
    arrays = sized(files, created, rows)
    for shard in range(3):
        part = slice(shard * layout.shard_rows, (shard + 1) * layout.shard_rows)
        fmt.write_shard_at(files, arrays, layout, shard, {name: column[part] for name, column in columns.items()})
    reopened = zarr.open_group(tmp_path / "d.zarr", mode="r")
    assert reopened.attrs["note"] == "made by batchctl" and sorted(reopened.array_keys()) == sorted(columns)
    for name, column in columns.items():
        stored = reopened[name][:]
        assert np.array_equal(fmt.decode_sources(stored) if name == metadata.SOURCE else stored, column), name
        assert files.arrays()[name] == arrays[name] == zarrmeta.ArrayMeta.of_zarr(reopened[name])
    with pytest.raises(batchctl.FormatError, match="does not fit"):  # a longer path than the width
        fmt.encode_sources(["abcd"], 3)
    reader = chunkread.ChunkReader.for_array(chunkread.DatasetRoot(tmp_path / "d.zarr"), arrays["x"])
    assert reader is not None
    assert np.array_equal(reader.read(6)[:3], columns["x"][24:27])


ZARR_COMPRESSORS = {  # what docs/format.md prescribes, as zarr-python's codec objects
    "zstd": lambda: [zarr.codecs.ZstdCodec(level=metadata.ZSTD_LEVEL, checksum=True)],
    "blosc": lambda: [
        zarr.codecs.BloscCodec(cname="zstd", clevel=metadata.ZSTD_LEVEL, shuffle="shuffle"),
        zarr.codecs.Crc32cCodec(),
    ],
    "none": lambda: [zarr.codecs.Crc32cCodec()],
}


@pytest.mark.parametrize("compression", ["zstd", "blosc", "none"])
@pytest.mark.parametrize(
    ("dtype", "shape"), [("uint8", (5, 3)), ("float32", (4,)), ("int64", ()), ("bool", (2,)), ("float16", ())]
)
def test_batchctls_documents_and_shards_are_zarr_pythons(
    tmp_path: Path, compression: str, dtype: str, shape: tuple[int, ...]
) -> None:
    """One writer, standard shards: the `zarr.json` documents batchctl writes without zarr-python,
    and the shard files its encoder writes (both engines), are what zarr-python writes for the
    same arrays and data."""
    layout = metadata.Layout(batch_size=4, shard_batches=3)
    rows = 10  # a short last chunk, and an empty position in the shard index
    data = (np.random.default_rng(1).random((rows, *shape)) * 100).astype(dtype)
    columns = {
        "x": data,
        metadata.SOURCE: np.array(["ab", "cdé"] * 5, dtype=object),
        metadata.SOURCE_INDEX: np.arange(rows),
    }
    files = zarrmeta.DatasetFiles(str(tmp_path / "ours.zarr"))
    files.create_group({"n": 1})
    schema = {"x": metadata.FieldSpec(shape, dtype)}
    ours = sized(files, fmt.create_arrays(files, schema, layout, compression, labelled=False, source_bytes=5), rows)
    fmt.write_shard_at(files, ours, layout, 0, columns)
    theirs = zarr.open_group(tmp_path / "theirs.zarr", mode="w", attributes={"n": 1})
    for name, arr in ours.items():
        made = theirs.create_array(
            name,
            shape=arr.shape,
            dtype=arr.dtype,
            chunks=arr.chunks,
            shards=arr.shards,
            compressors=ZARR_COMPRESSORS[compression](),
            dimension_names=arr.dimension_names,
            config={"write_empty_chunks": True},
        )
        made[:] = fmt.stored_column(arr, name, columns[name])
    for key in ["zarr.json"] + [f"{name}/zarr.json" for name in ours]:
        assert json.loads((tmp_path / "ours.zarr" / key).read_bytes()) == json.loads(
            (tmp_path / "theirs.zarr" / key).read_bytes()
        ), key
    for name in ours:
        key = ours[name].shard_key(0)
        assert (tmp_path / "ours.zarr" / key).read_bytes() == (tmp_path / "theirs.zarr" / key).read_bytes(), name


def test_fields_batchctl_cannot_store_are_refused_in_one_line(tmp_path: Path) -> None:
    files = zarrmeta.DatasetFiles(str(tmp_path / "d.zarr"))
    files.create_group({})
    layout = metadata.Layout(batch_size=4, shard_batches=3)
    for dtype in ("<U3", "complex64", "object"):
        with pytest.raises(batchctl.FormatError, match=f"'name' has data type {dtype}: batchctl stores integers"):
            fmt.create_arrays(files, {"name": metadata.FieldSpec((), dtype)}, layout, "zstd", False, 5)


def test_crc32c_through_the_wheels_library_agrees_with_google_crc32c() -> None:
    """batchctl.store.crc calls google-crc32c's own library through ctypes (the GIL released):
    in use here, and the same checksums, whole or continued piece by piece, of any buffer."""
    import google_crc32c

    from batchctl.store import crc

    assert crc.RELEASES_GIL  # the wheel's library was found: not the GIL-holding fallback
    data = np.random.default_rng(0).integers(0, 256, 3_000_001, dtype=np.uint8)
    expected = google_crc32c.value(data.tobytes())
    assert crc.crc32c(data) == crc.crc32c(data.tobytes()) == crc.crc32c(bytearray(data.tobytes())) == expected
    assert crc.crc32c(memoryview(data.tobytes())[1000:]) == google_crc32c.value(data.tobytes()[1000:])
    pieces = np.array_split(data, 7)
    running = 0
    for piece in pieces:
        running = crc.crc32c(piece, running)
    assert running == expected and crc.crc32c(b"") == 0 and crc.crc32c(b"", 123) == 123
    with pytest.raises(ValueError, match="contiguous"):
        crc.crc32c(data[::2])
