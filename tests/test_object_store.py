"""Datasets on an S3 API: a real moto server on loopback, driven through s3fs and the real CLI."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import batchctl
from batchctl.read.inspect import verify
from batchctl.store.remote import SMALL_SHARD_BYTES
from batchctl.synthetic import make_image_folder
from tests.test_build import image_files

from .conftest import PLUGINS, free_port, kill_group, run_cli, start_cli, wait_for, wait_group_gone
from .ranks import run_ranks
from .s3server import Relay, data_gets, range_bytes, requests_made, s3_environment, start_moto
from .test_incremental import LAYOUT, assert_same_rows, change_files, new_image, rows_by_key

s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto")

SLOW = ["--preprocess", f"{PLUGINS}:slow_image", "--batch-size", "4", "--shard-batches", "1", "--workers", "2"]


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A moto S3 server in its own process on a free loopback port; credentials in the environment."""
    port = free_port()
    server = start_moto(port, tmp_path_factory.mktemp("moto"))
    try:
        with s3_environment():
            yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.fixture
def bucket(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """A fresh bucket; AWS_ENDPOINT_URL points at the server for the CLI and for this process."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # where URL builds keep their lock
    name = f"b{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(endpoint_url=s3_endpoint).mkdir(name)
    return name


def _fs(endpoint: str) -> s3fs.S3FileSystem:
    return s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)


def _rows_by_source(ds: batchctl.Dataset) -> dict[tuple[str, int], np.ndarray]:
    rows = {}
    for batch in ds:
        for source, index, image in zip(batch["source"], batch["source_index"], batch["image"], strict=True):
            rows[(str(source), int(index))] = image
    return rows


def test_build_to_s3_reads_back_exactly_once_and_is_up_to_date(
    image_folder: Path, bucket: str, s3_endpoint: str, tmp_path: Path
) -> None:
    url, local = f"s3://{bucket}/imgs.zarr", tmp_path / "local.zarr"
    report = tmp_path / "r.json"
    result = run_cli("build", image_folder, "-o", url, "--batch-size", "8", "--workers", "2", "--report", report)
    assert result.returncode == 0, result.stderr
    assert json.loads(report.read_text())["status"] == "complete"
    assert run_cli("build", image_folder, "-o", local, "--batch-size", "8", "--workers", "2").returncode == 0

    remote_rows, local_rows = _rows_by_source(batchctl.open(url)), _rows_by_source(batchctl.open(local))
    assert len(remote_rows) == 60 and remote_rows.keys() == local_rows.keys()
    for key, image in remote_rows.items():
        np.testing.assert_array_equal(image, local_rows[key])
    assert verify(url) == []
    assert not _fs(s3_endpoint).exists(f"{bucket}/.imgs.zarr.batchctl")  # no work objects left behind
    # the training loader reads the bucket through zarr: its rows are those its order names
    ds = batchctl.open(url)
    loader = ds.loader(batch_size=5, mix=4, seed=2)
    stored = np.concatenate([ds[i]["source"] for i in range(len(ds))])
    got = [b for b in loader]
    assert [b["source"].tolist() for b in got] == [stored[loader.order(0).rows(j)].tolist() for j in range(12)]
    for batch in got:
        for source, image in zip(batch["source"], batch["image"], strict=True):
            np.testing.assert_array_equal(image, local_rows[(str(source), 0)])

    data = json.loads(run_cli("info", url, "--json").stdout)
    assert data["complete"] and data["num_samples"] == 60 and data["bytes"] > 0
    assert run_cli("verify", url).returncode == 0

    again = run_cli("build", image_folder, "-o", url, "--batch-size", "8", "--workers", "2")
    assert again.returncode == 0 and "up to date" in again.stderr


def test_interrupted_s3_build_is_not_readable_and_resumes(image_folder: Path, bucket: str, s3_endpoint: str) -> None:
    url = f"s3://{bucket}/slow.zarr"
    fs = _fs(s3_endpoint)

    def journaled() -> int:
        fs.invalidate_cache()
        where = f"{bucket}/.slow.zarr.batchctl/journal"
        return len(fs.ls(where)) if fs.exists(where) else 0

    proc = start_cli("build", image_folder, "-o", url, *SLOW)
    wait_for(lambda: journaled() >= 2)
    kill_group(proc, signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert wait_group_gone(proc.pid) == []
    with pytest.raises(batchctl.IncompleteDatasetError):
        batchctl.open(url)
    assert run_cli("verify", url).returncode == 1  # not marked complete

    result = run_cli("build", image_folder, "-o", url, *SLOW)
    assert result.returncode == 0, result.stderr
    assert "resuming" in result.stderr
    ds = batchctl.open(url)
    sources = sorted(str(s) for b in ds for s in b["source"])
    assert sources == sorted(image_files(image_folder))
    assert verify(url) == []


def test_endpoint_given_as_storage_option(
    image_folder: Path, bucket: str, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    url, option = f"s3://{bucket}/opt.zarr", f"endpoint_url={s3_endpoint}"
    result = run_cli("build", image_folder, "-o", url, "--workers", "1", "--storage-option", option)
    assert result.returncode == 0, result.stderr
    ds = batchctl.open(url, storage_options={"endpoint_url": s3_endpoint})
    assert ds.num_samples == 60
    assert json.loads(run_cli("info", url, "--json", "--storage-option", option).stdout)["num_samples"] == 60


def test_refuses_a_prefix_that_is_not_a_dataset_and_a_missing_bucket(
    image_folder: Path, bucket: str, s3_endpoint: str
) -> None:
    _fs(s3_endpoint).pipe_file(f"{bucket}/precious/notes.txt", b"keep me")
    result = run_cli("build", image_folder, "-o", f"s3://{bucket}/precious")
    assert result.returncode == 2 and "refusing to replace" in result.stderr
    assert _fs(s3_endpoint).cat_file(f"{bucket}/precious/notes.txt") == b"keep me"
    missing = run_cli("build", image_folder, "-o", "s3://no-such-bucket-here/x.zarr")
    assert missing.returncode == 2 and "no bucket" in missing.stderr and "Traceback" not in missing.stderr


def test_source_on_s3_builds_the_same_rows_as_the_local_folder(
    image_folder: Path, bucket: str, s3_endpoint: str, tmp_path: Path
) -> None:
    fs = _fs(s3_endpoint)
    fs.put(str(image_folder), f"{bucket}/raw", recursive=True)
    fs.pipe_file(f"{bucket}/raw/cat/broken.jpg", b"not a jpeg")
    remote, local = tmp_path / "from_s3.zarr", tmp_path / "from_disk.zarr"
    report = tmp_path / "r.json"
    result = run_cli("build", f"s3://{bucket}/raw/", "-o", remote, "--workers", "2", "--report", report)
    assert result.returncode == 0, result.stderr
    assert "cat/broken.jpg" in result.stderr
    assert [e["source"] for e in json.loads(report.read_text())["errors"]] == ["cat/broken.jpg"]
    assert run_cli("build", image_folder, "-o", local, "--workers", "2").returncode == 0
    remote_ds, local_ds = batchctl.open(remote), batchctl.open(local)
    assert remote_ds.classes == local_ds.classes
    remote_rows, local_rows = _rows_by_source(remote_ds), _rows_by_source(local_ds)
    assert remote_rows.keys() == local_rows.keys() and len(remote_rows) == 60
    for key, image in remote_rows.items():
        np.testing.assert_array_equal(image, local_rows[key])
    assert not list(Path(tempfile.gettempdir()).glob("batchctl-*"))  # every fetched copy removed

    again = run_cli("build", f"s3://{bucket}/raw/", "-o", remote, "--workers", "2")
    assert again.returncode == 0 and "up to date" in again.stderr


def test_incremental_rounds_on_s3_and_an_interrupted_one_resumes(bucket: str, s3_endpoint: str, tmp_path: Path) -> None:
    folder = tmp_path / "data"
    make_image_folder(folder, 40, sides=(60, 120))
    slow = ["--preprocess", f"{PLUGINS}:slow_image", "--option", "delay=0.1", *LAYOUT]
    url, report = f"s3://{bucket}/inc.zarr", tmp_path / "r.json"
    fs = _fs(s3_endpoint)

    def fresh_rows(name: str) -> dict:
        assert run_cli("build", folder, "-o", tmp_path / name, *slow).returncode == 0
        return rows_by_key(tmp_path / name)

    assert run_cli("build", folder, "-o", url, *slow).returncode == 0
    for round_ in range(2):
        changed = change_files(folder, round_)
        result = run_cli("build", folder, "-o", url, *slow, "--report", report)
        assert result.returncode == 0, result.stderr
        data = json.loads(report.read_text())
        assert data["added"] is not None, result.stderr
        assert {key: data[key]["paths"] for key in ("added", "changed", "removed")} == changed
        assert data["processed"] == len(changed["added"]) + len(changed["changed"])
        assert_same_rows(rows_by_key(url), fresh_rows(f"fresh{round_}.zarr"))
        assert verify(url) == []

    for i in range(16):
        new_image(tmp_path, folder / "cat" / f"new{i}.jpg", 40 + i)
    journal = f"{bucket}/.inc.zarr.batchctl/journal"

    def new_shards_journaled() -> bool:
        fs.invalidate_cache()
        return fs.exists(journal) and len(fs.ls(journal)) >= 3  # the kept shards' object, then two new shards

    proc = start_cli("build", folder, "-o", url, *slow)
    wait_for(new_shards_journaled)
    kill_group(proc, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 143, stderr
    result = run_cli("build", folder, "-o", url, *slow, "--report", report)
    assert result.returncode == 0, result.stderr
    data = json.loads(report.read_text())
    assert data["resumed_samples"] >= 8 and data["added"]["count"] == 16 and data["processed"] <= 16 - 8
    assert_same_rows(rows_by_key(url), fresh_rows("fresh2.zarr"))
    assert verify(url) == []


@pytest.fixture
def own_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A moto server of this test's alone (it will be stopped or killed), with a bucket."""
    port = free_port()
    log = open(tmp_path / "moto.log", "w")  # noqa: SIM115 - closed below
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log
    )
    endpoint = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    try:
        wait_for(lambda: _listening(port), timeout=30)
        _fs(endpoint).mkdir("lost")
        yield server, endpoint
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.kill()
        server.wait(timeout=10)
        log.close()


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP])
@pytest.mark.parametrize("moment", [0.0, 0.7])
def test_a_store_that_goes_away_or_freezes_mid_build_ends_it_in_one_line(
    image_folder: Path, own_server: tuple[subprocess.Popen[bytes], str], how: int, moment: float
) -> None:
    """Killed, the server refuses connections; stopped, it accepts them and never answers: either
    way the build ends non-zero within its timeouts, in one line naming the store, no traceback,
    and says that OUTPUT was left marked incomplete (it is written in place)."""
    server, endpoint = own_server
    proc = start_cli(
        "build", image_folder, "-o", "s3://lost/data.zarr", *SLOW, "--storage-option",
        'config_kwargs={"connect_timeout": 2, "read_timeout": 2, "retries": {"max_attempts": 1}}',
        "--storage-option", "io_timeout=5",
    )  # fmt: skip
    wait_for(lambda: _fs(endpoint).exists("lost/.data.zarr.batchctl/state.json"), timeout=30)  # it has begun
    time.sleep(moment)
    os.kill(server.pid, how)
    sent = time.monotonic()
    try:
        _, stderr = proc.communicate(timeout=90)
    finally:
        kill_group(proc)
    took = time.monotonic() - sent
    assert proc.returncode == 1, stderr
    assert "Traceback" not in stderr and "botocore" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("batchctl: error:")]
    assert len(errors) == 1 and "lost/data.zarr" in errors[0], stderr
    assert "OUTPUT is marked incomplete until a rerun finishes it" in stderr, stderr
    assert took < 60, took
    assert wait_group_gone(proc.pid) == []


def test_each_batch_is_one_ranged_read_of_its_bytes(image_folder: Path, bucket: str, s3_endpoint: str) -> None:
    """Counted at the server: reading every batch of a URL dataset fetches each shard's index once
    and each batch's chunk bytes once (one ranged GET per field and batch), never a whole object;
    a shard whose chunks are small (labels, sources) has them fetched in one ranged GET, kept."""
    url = f"s3://{bucket}/ranged.zarr"
    args = ("--batch-size", "8", "--shard-batches", "3", "--resize", "64", "--crop", "64", "--compression", "none")
    assert run_cli("build", image_folder, "-o", url, *args).returncode == 0
    ds = batchctl.open(url)
    batches = len(ds)
    fs = _fs(s3_endpoint)
    objects = {p: fs.size(p) for p in fs.find(f"{bucket}/ranged.zarr") if "/c/" in p}
    expected = 0
    for path, size in objects.items():
        shard_batches = 3 if int(path.rsplit("/c/", 1)[1].split("/")[0]) < batches // 3 else batches % 3 or 3
        data = size - 3 * 16 - 4  # the index: an offset and a size per batch, and a checksum
        expected += 1 + (1 if data <= SMALL_SHARD_BYTES else shard_batches)  # the index, then the chunks
    assert any(size > SMALL_SHARD_BYTES + 100 for size in objects.values())  # both kinds are read here
    with requests_made(s3_endpoint) as made:
        for i in range(batches):
            ds[i]
    shard_gets = data_gets(made)
    sizes = [range_bytes(r) for r in shard_gets]
    assert None not in sizes  # no whole-object download
    assert len(shard_gets) == expected
    fetched = sum(size for size in sizes if size is not None)
    assert fetched <= 1.02 * sum(objects.values()), (fetched, objects)  # indexes included


# shards of images too big to be fetched whole (SMALL_SHARD_BYTES): one ranged read per batch
READ_LAYOUT = ("--batch-size", "8", "--shard-batches", "3", "--resize", "64", "--crop", "64", "--compression", "none")


def _epoch(ds: batchctl.Dataset, **options: Any) -> list[dict[str, np.ndarray]]:
    return list(ds.loader(batch_size=5, mix=4, seed=3, **options))


def _same_batches(got: list[dict[str, np.ndarray]], want: list[dict[str, np.ndarray]]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.keys() == b.keys()
        for name in a:
            np.testing.assert_array_equal(a[name], b[name])


def _built(tmp_path: Path, bucket: str, name: str, images: int) -> tuple[Path, str]:
    """A folder of `images` small images, built at s3://BUCKET/NAME.zarr in READ_LAYOUT."""
    folder, url = tmp_path / "data", f"s3://{bucket}/{name}.zarr"
    make_image_folder(folder, images, sides=(40, 80))
    assert run_cli("build", folder, "-o", url, *READ_LAYOUT).returncode == 0
    return folder, url


def _cached_bytes(cache: Path) -> int:
    """What the cache holds on disk: its files, written and being written (the ledger aside)."""
    return sum(f.stat().st_size for f in (cache / "data").iterdir()) if (cache / "data").exists() else 0


def test_two_nodes_of_ranks_and_workers_fetch_each_stored_byte_once(
    tmp_path: Path, bucket: str, s3_endpoint: str
) -> None:
    """2 simulated nodes (a cache folder each) x 2 ranks x 2 DataLoader workers, counted at the
    server: the nodes together fetch the stored bytes once (each stored batch by the one consumer
    whose share holds it, but those a cut between two shares splits), not once per node or per
    consumer; every row of the order once."""
    pytest.importorskip("torch")
    _, url = _built(tmp_path, bucket, "nodes", 120)
    fs = _fs(s3_endpoint)
    stored = sum(fs.size(p) for p in fs.find(f"{bucket}/nodes.zarr") if "/c/" in p)
    options = {"batch_size": 4, "mix": 4, "seed": 2}
    with requests_made(s3_endpoint) as made:
        ranks = run_ranks(url, 4, 2, options, nodes=2, cache_root=tmp_path / "caches")
    sizes = [range_bytes(r) for r in data_gets(made)]
    assert None not in sizes
    fetched = sum(size for size in sizes if size is not None)
    ds = batchctl.open(url)
    one = stored / len(ds)  # a stored batch's bytes: each of the 7 cuts between the 8 shares may split one
    assert fetched <= 1.02 * stored + 7 * one, fetched / stored
    order = ds.loader(**options, partitions=8).order(0)
    taken = order.batches - order.batches % 4  # (drop_last: the last round the 4 ranks cannot share)
    want = sorted(str(ds.sample(int(row))["source"]) for j in range(taken) for row in order.rows(j))
    got = [s for rank in ranks for s in rank["sources"]]
    assert sorted(got) == want and len(set(got)) == len(got)
    assert {p.name for p in (tmp_path / "caches").iterdir()} == {"node0", "node1"}


def test_a_cached_epoch_sends_no_data_gets_and_a_rebuild_is_never_served_stale(
    tmp_path: Path, bucket: str, s3_endpoint: str
) -> None:
    folder, url = _built(tmp_path, bucket, "cached", 40)
    cache = tmp_path / "cache"
    plain = _epoch(batchctl.open(url))
    with requests_made(s3_endpoint) as first:
        _same_batches(_epoch(batchctl.open(url, cache_dir=cache, cache_limit="1GB")), plain)
    with requests_made(s3_endpoint) as second:  # a new process's view: nothing kept in memory
        again = batchctl.open(url, cache_dir=cache, cache_limit="1GB")
        _same_batches(_epoch(again), plain)
    assert data_gets(first) and data_gets(second) == []
    assert 0 < _cached_bytes(cache) == again.cache.held_bytes()  # type: ignore[union-attr]

    victim = sorted((folder / "cat").glob("*.jpg"))[0]
    source = f"cat/{victim.name}"
    new_image(tmp_path, victim, 99)  # a changed file: a new version at the URL
    assert run_cli("build", folder, "-o", url, *READ_LAYOUT).returncode == 0
    rebuilt = batchctl.open(url, cache_dir=cache, cache_limit="1GB")
    assert rebuilt.build_id != again.build_id
    assert _cached_bytes(cache) == 0  # the old version's files are dropped as the new one is opened
    _same_batches(_epoch(rebuilt), _epoch(batchctl.open(url)))

    def image_of(batches: list[dict[str, np.ndarray]]) -> np.ndarray:
        return next(img for b in batches for s, img in zip(b["source"], b["image"], strict=True) if s == source)

    assert not np.array_equal(image_of(_epoch(rebuilt)), image_of(plain))  # the new bytes, not the cached old ones


_READER = """
import hashlib, json, sys
import batchctl
url, cache, limit = sys.argv[1:4]
ds = batchctl.open(url, cache_dir=cache, cache_limit=int(limit))
digest = hashlib.sha256()
for epoch in range(2):
    loader = ds.loader(batch_size=5, mix=4, seed=3, prefetch=2)
    loader.set_epoch(epoch)
    for batch in loader:
        digest.update(batch["image"].tobytes())
print(digest.hexdigest())
"""


def test_two_processes_sharing_a_cache_hold_its_limit_and_a_too_small_one_is_refused(
    tmp_path: Path, bucket: str, s3_endpoint: str
) -> None:
    _, url = _built(tmp_path, bucket, "shared", 60)
    cache = tmp_path / "cache"
    ds = batchctl.open(url)
    limit = 6 * ds.stored_batch_bytes()  # about a third of the dataset: evictions all the time
    want = hashlib.sha256()
    for epoch in range(2):
        loader = ds.loader(batch_size=5, mix=4, seed=3)
        loader.set_epoch(epoch)
        for batch in loader:
            want.update(batch["image"].tobytes())
    readers = [
        subprocess.Popen(
            [sys.executable, "-c", _READER, url, str(cache), str(limit)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    peak = 0
    while any(r.poll() is None for r in readers):
        with contextlib.suppress(FileNotFoundError):  # a file evicted while it was counted
            peak = max(peak, _cached_bytes(cache))
    assert [r.communicate()[0].strip() for r in readers] == [want.hexdigest()] * 2
    assert [r.returncode for r in readers] == [0, 0]
    assert 0 < peak <= limit and _cached_bytes(cache) <= limit

    small = batchctl.open(url, cache_dir=cache, cache_limit=ds.stored_batch_bytes() * 3)
    with pytest.raises(batchctl.UsageError, match="cache_limit") as refused:
        small.loader(prefetch=8)
    assert "\n" not in str(refused.value) and "prefetch" in str(refused.value)

    torch = pytest.importorskip("torch")
    from batchctl.torch import IterableBatches

    # DataLoader workers (forked with the dataset opened) share the cache too
    stream = IterableBatches(url, batch_size=5, mix=4, seed=3, cache_dir=cache, cache_limit=limit)
    images = [b["image"] for b in torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2)]
    order = [b["image"] for b in ds.loader(batch_size=5, mix=4, seed=3, partitions=2)]  # one per worker
    assert [i.numpy().tobytes() for i in images] == [i.tobytes() for i in order]
    assert _cached_bytes(cache) <= limit


def test_a_deleted_cache_folder_and_a_corrupt_cached_file_are_fetched_again(
    tmp_path: Path, bucket: str, s3_endpoint: str
) -> None:
    _, url = _built(tmp_path, bucket, "damage", 96)  # 12 stored batches: 3 groups of mix=4
    cache = tmp_path / "cache"
    plain = _epoch(batchctl.open(url))
    got = []
    for i, batch in enumerate(
        batchctl.open(url, cache_dir=cache, cache_limit="1GB").loader(batch_size=5, mix=4, seed=3)
    ):
        got.append(batch)
        if i == 1:  # mid-epoch (moved away first: the readers keep writing while it is deleted)
            cache.rename(tmp_path / "deleted")
            shutil.rmtree(tmp_path / "deleted", ignore_errors=True)
    _same_batches(got, plain)
    assert _cached_bytes(cache) > 0 and not list(cache.glob("data/*.partial"))  # fetched, and cached again

    _epoch(batchctl.open(url, cache_dir=cache, cache_limit="1GB"))  # everything cached
    files = sorted((cache / "data").iterdir())
    for file in files:  # every cached index and chunk damaged on local disk
        data = bytearray(file.read_bytes())
        data[len(data) // 2] ^= 0xFF
        file.write_bytes(bytes(data))
    with requests_made(s3_endpoint) as made:
        _same_batches(_epoch(batchctl.open(url, cache_dir=cache, cache_limit="1GB")), plain)
    assert len(data_gets(made)) == len(files)  # each damaged file fetched once more
    with requests_made(s3_endpoint) as made:
        _same_batches(_epoch(batchctl.open(url, cache_dir=cache, cache_limit="1GB")), plain)
    assert data_gets(made) == []  # and kept, sound, in place of the damaged one


def test_reads_ride_out_a_store_restart_and_end_in_one_error_when_it_stays_down(
    tmp_path: Path, bucket: str, s3_endpoint: str
) -> None:
    """The moto server behind a relay on loopback: stopping the relay is, to the reader, the
    store going down (refused and reset connections) while its objects stay."""
    _, url = _built(tmp_path, bucket, "flaky", 40)
    plain = _epoch(batchctl.open(url))
    relay = Relay(int(s3_endpoint.rsplit(":", 1)[1])).start()
    try:
        options = {"endpoint_url": relay.endpoint}
        ds = batchctl.open(url, storage_options=options, retry_for=60)
        got = []
        for i, batch in enumerate(ds.loader(batch_size=5, mix=4, seed=3, prefetch=2)):
            got.append(batch)
            if i == 1:
                relay.stop()
                threading.Timer(1.5, relay.start).start()  # down for 1.5 s mid-epoch
        _same_batches(got, plain)

        down = batchctl.open(url, storage_options=options, retry_for=2)
        relay.stop()
        stopped = time.monotonic()
        with pytest.raises(OSError) as ended:
            _epoch(down)
        took = time.monotonic() - stopped
        message = str(ended.value)
        assert "\n" not in message and url in message and "no answer for 2 s" in message, message
        assert took < 2 + 2 * 2 + 5, took  # the retry time, and an attempt (2 s here) on each side of it
    finally:
        relay.stop()


def test_exact_resume_from_a_url(tmp_path: Path, bucket: str, s3_endpoint: str) -> None:
    _, url = _built(tmp_path, bucket, "resume", 40)
    cache = tmp_path / "cache"
    whole = _epoch(batchctl.open(url))
    loader = batchctl.open(url, cache_dir=cache, cache_limit="1GB").loader(batch_size=5, mix=4, seed=3)
    first = [batch for _, batch in zip(range(3), loader, strict=False)]
    state = json.loads(json.dumps(loader.state_dict()))
    resumed = batchctl.open(url).loader(batch_size=5, mix=4, seed=3)
    resumed.load_state_dict(state)
    _same_batches(first + list(resumed), whole)


def test_a_corrupt_object_is_one_error_naming_its_shard_and_batch(
    tmp_path: Path, bucket: str, s3_endpoint: str
) -> None:
    _, url = _built(tmp_path, bucket, "corrupt", 40)
    ds = batchctl.open(url)
    reader = ds._fast["image"]
    ds[4]  # loads shard 1's index
    where = reader.chunk_range(4)  # type: ignore[union-attr]
    fs = _fs(s3_endpoint)
    data = bytearray(fs.cat_file(where.path))
    data[(where.start + where.end) // 2] ^= 0xFF  # type: ignore[operator]
    fs.pipe_file(where.path, bytes(data))
    with pytest.raises(batchctl.FormatError) as damaged:
        _epoch(batchctl.open(url))
    message = str(damaged.value)
    assert "\n" not in message and "image shard 1, batch 4" in message, message


# --- the read cache is a trust boundary ----------------------------------------------------------

OTHER_UID = 65534  # nobody


def _plant_row(ledger: Path, name: str, url: str, version: str) -> None:
    import sqlite3

    with sqlite3.connect(ledger) as db:
        db.execute("INSERT INTO entries VALUES (?, ?, ?, 10, 0, 1, 1, 'x')", (name, url, version))


def test_a_cache_dir_of_another_user_or_writable_by_others_is_refused_and_no_name_leaves_it(
    tmp_path: Path, bucket: str, s3_endpoint: str
) -> None:
    _, url = _built(tmp_path, bucket, "planted", 16)
    secret = tmp_path / "victim_secret.txt"
    secret.write_text("mine")
    # another user made the cache_dir first in a shared folder (sticky, as /tmp) and planted a ledger
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o1777)
    shared.chmod(0o1777)
    planted = shared / "cache"
    batchctl.open(url, cache_dir=planted, cache_limit="1GB").cache.close()  # type: ignore[union-attr]
    _plant_row(planted / "ledger.sqlite3", "../../../victim_secret.txt", url, "an older version")
    for path in [planted, *planted.rglob("*")]:
        os.chown(path, OTHER_UID, OTHER_UID)
    with pytest.raises(batchctl.UsageError, match="not a private folder of yours") as refused:
        batchctl.open(url, cache_dir=planted, cache_limit="1GB")
    assert "\n" not in str(refused.value)
    assert secret.read_text() == "mine"
    for path in [planted, *planted.rglob("*")]:
        os.chown(path, os.getuid(), os.getgid())
    planted.chmod(0o777)  # the user's own, but anyone may write into it
    with pytest.raises(batchctl.UsageError, match="not a private folder of yours"):
        batchctl.open(url, cache_dir=planted, cache_limit="1GB")
    # a ledger row naming a path outside the folder (a tampered ledger in a private folder): only the row goes
    planted.chmod(0o700)
    ds = batchctl.open(url, cache_dir=planted, cache_limit="1GB")
    assert secret.read_text() == "mine"
    _same_batches(_epoch(ds), _epoch(batchctl.open(url)))
    folders = {stat_mode(p) for p in [planted, planted / "data"]}
    files = {stat_mode(p) for p in planted.rglob("*") if p.is_file()}
    assert (folders, files) == ({0o700}, {0o600}), (folders, files)  # what was cached is the user's only


def test_a_cache_dir_planted_as_a_symlink_to_a_folder_of_the_users_is_refused_and_changes_nothing(
    tmp_path: Path, bucket: str, s3_endpoint: str
) -> None:
    _, url = _built(tmp_path, bucket, "linked", 16)
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o755)
    victim.chmod(0o755)
    (victim / "notes.txt").write_text("mine")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o1777)
    shared.chmod(0o1777)
    planted = shared / "cache"
    planted.symlink_to(victim)
    os.lchown(planted, OTHER_UID, OTHER_UID)  # another user's link
    for link in (planted, tmp_path / "own-link"):
        if not link.is_symlink():
            link.symlink_to(victim)  # (the user's own link: refused too, it points elsewhere)
        with pytest.raises(batchctl.UsageError, match="is a symbolic link") as refused:
            batchctl.open(url, cache_dir=link, cache_limit="1GB")
        assert "\n" not in str(refused.value)
        assert stat_mode(victim) == 0o755 and sorted(p.name for p in victim.iterdir()) == ["notes.txt"]


def stat_mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_a_swapped_or_crafted_cached_chunk_is_fetched_again_never_served(
    tmp_path: Path, bucket: str, s3_endpoint: str
) -> None:
    import google_crc32c

    _, url = _built(tmp_path, bucket, "swapped", 48)
    cache = tmp_path / "cache"
    plain = _epoch(batchctl.open(url))
    _epoch(batchctl.open(url, cache_dir=cache, cache_limit="1GB"))
    by_size: dict[int, list[Path]] = {}
    for file in (cache / "data").iterdir():
        by_size.setdefault(file.stat().st_size, []).append(file)
    a, b, c = by_size[max(size for size, files in by_size.items() if len(files) >= 3)][:3]  # image chunks, one length
    first, second = a.read_bytes(), b.read_bytes()
    a.write_bytes(second)  # two valid chunks swapped (another user, anything that renames files)
    b.write_bytes(first)
    crafted = bytearray(c.read_bytes())
    crafted[10] ^= 0xFF  # a wrong pixel with its crc32c made again: checksums alone would pass it
    crafted[-4:] = int(google_crc32c.value(bytes(crafted[:-4]))).to_bytes(4, "little")
    c.write_bytes(bytes(crafted))
    with requests_made(s3_endpoint) as made:
        _same_batches(_epoch(batchctl.open(url, cache_dir=cache, cache_limit="1GB")), plain)
    assert len(data_gets(made)) == 3  # each fetched once more, and cached right
    assert a.read_bytes() == first and b.read_bytes() == second


@pytest.mark.parametrize("damage", ["garbage", "half", "a folder", "emptied"])
def test_a_damaged_or_emptied_ledger_is_rebuilt_in_one_line_and_the_limit_holds(
    tmp_path: Path, bucket: str, s3_endpoint: str, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    import sqlite3

    _, url = _built(tmp_path, bucket, "ledger", 48)
    cache = tmp_path / "cache"
    plain = _epoch(batchctl.open(url))
    _epoch(batchctl.open(url, cache_dir=cache, cache_limit="1GB"))
    ledger = cache / "ledger.sqlite3"
    if damage == "garbage":
        ledger.write_bytes(os.urandom(8192))
    elif damage == "half":
        ledger.write_bytes(ledger.read_bytes()[: ledger.stat().st_size // 2])
    elif damage == "a folder":
        ledger.unlink()
        ledger.mkdir()
    else:
        with sqlite3.connect(ledger) as db:
            db.execute("DELETE FROM entries")
    limit = 4 * batchctl.open(url).stored_batch_bytes()
    with caplog.at_level("WARNING", logger="batchctl"):
        ds = batchctl.open(url, cache_dir=cache, cache_limit=limit)
        _same_batches(_epoch(ds, prefetch=2), plain)
    warnings = [r.getMessage() for r in caplog.records if r.name == "batchctl"]
    if damage == "emptied":
        assert warnings == []  # nothing is wrong with the ledger: its files without a row are deleted
    else:
        assert len(warnings) == 1 and "ledger" in warnings[0] and "\n" not in warnings[0], warnings
    assert 0 < _cached_bytes(cache) <= limit
    assert _cached_bytes(cache) == ds.cache.held_bytes()  # type: ignore[union-attr]


def test_an_unreachable_store_or_missing_credentials_on_open_is_one_line(
    tmp_path: Path, bucket: str, s3_endpoint: str
) -> None:
    _, url = _built(tmp_path, bucket, "reach", 16)
    closed = f"endpoint_url=http://127.0.0.1:{free_port()}"  # nothing listens there
    commands = (["info", url], ["verify", url], ["preview", url, "-o", tmp_path / "p.png"])
    # all at once: each waits out its timeout (the client retries a refused connection until then)
    running = [
        start_cli(*command, "--storage-option", closed, "--storage-option", "io_timeout=1") for command in commands
    ]
    for proc in running:
        _, stderr = proc.communicate(timeout=90)
        assert proc.returncode == 1, stderr
        assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
        assert stderr.startswith(("batchctl: error: s3://", f"batchctl: error: cannot open {url}")), stderr
        assert "zarr.json" in stderr
        assert "could not connect" in stderr.lower() or "no answer in 1 s" in stderr
    with pytest.raises(batchctl.StoreError) as caught:  # a BatchctlError (and an OSError) of one line
        batchctl.open(url, storage_options={"endpoint_url": closed.split("=", 1)[1], "io_timeout": 1})
    assert isinstance(caught.value, batchctl.BatchctlError) and isinstance(caught.value, OSError)
    assert "\n" not in str(caught.value) and str(caught.value).startswith(f"cannot open {url}: ")
    assert "check the URL, the network and storage_options" in str(caught.value)
    bare = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    bare.update(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"))
    result = run_cli("info", url, "--storage-option", f"endpoint_url={s3_endpoint}", env=bare)
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert "credentials" in result.stderr.lower(), result.stderr
    # and preview reads from a URL like info and verify
    drawn = run_cli("preview", url, "-o", tmp_path / "p.png", "--storage-option", f"endpoint_url={s3_endpoint}")
    assert drawn.returncode == 0 and (tmp_path / "p.png").stat().st_size > 0, drawn.stderr


def test_ragged_fields_and_encoded_images_on_s3(bucket: str, s3_endpoint: str, tmp_path: Path) -> None:
    """A ragged build at a URL: the same digest as the local build of the same files, rows read
    back exactly (batchctl and zarr-python), an incremental round carrying ragged rows, and
    encoded images decoded and cropped from the bucket."""
    from .test_ragged import PLUGIN, assert_dataset_is_the_folder, write_docs

    folder = tmp_path / "docs"
    write_docs(folder, 60, seed=3)
    url, local = f"s3://{bucket}/ragged.zarr", tmp_path / "local.zarr"
    args = ["--preprocess", PLUGIN, "--batch-size", "8", "--shard-batches", "2"]
    assert run_cli("build", folder, "-o", url, *args).returncode == 0
    assert run_cli("build", folder, "-o", local, *args).returncode == 0
    assert batchctl.open(url).build_id == batchctl.open(local).build_id
    (folder / "doc0004.txt").write_bytes(b"a changed document")
    write_docs(folder, 5, seed=4, start=60)
    result = run_cli("build", folder, "-o", url, *args)
    assert result.returncode == 0 and "added" in result.stderr, result.stderr
    assert_dataset_is_the_folder(url, folder)

    ds = batchctl.open(url)  # each batch's values: one ranged GET per field, its shard's index once
    with requests_made(s3_endpoint) as made:
        rows = [ds.read_batch(i, fields=["tokens"])["tokens"] for i in range(len(ds))]
    values_gets = [r for r in data_gets(made) if "/tokens.values/" in r["url"]]
    shards = -(-len(ds) // 2)
    assert len(values_gets) == len(ds) + shards and all(range_bytes(r) for r in values_gets)
    fs = _fs(s3_endpoint)  # a values shard gone: an error naming it, never rows of fill values
    gone = f"{bucket}/ragged.zarr/tokens.values/c/1/0"
    assert fs.exists(gone) and sum(len(r) for r in rows) > 0
    fs.rm(gone)
    with pytest.raises(batchctl.FormatError, match=r"tokens\.values/c/1/0 is missing"):
        batchctl.open(url).read_batch(2, fields=["tokens"])

    photos = tmp_path / "photos"
    make_image_folder(photos, 12, sides=(80, 160))
    images = f"s3://{bucket}/jpeg.zarr"
    assert run_cli("build", photos, "-o", images, "--store", "jpeg", "--batch-size", "4").returncode == 0
    got = [b["image"].shape for b in batchctl.open(images).loader(batch_size=4, random_resized_crop=32, flip=True)]
    assert got == [(4, 32, 32, 3)] * 3


def test_carried_rows_at_a_url_are_read_checked_and_a_missing_shard_is_an_error(
    tmp_path: Path, bucket: str, s3_endpoint: str
) -> None:
    """The reader an incremental build carries rows with (`store.rowread.RowReader`) reads a URL's
    rows as `batchctl.open` does, and a shard gone is an error naming it, not rows of zeros (as
    zarr-python reads it, which is what this reader used at a URL)."""
    import zarr

    from batchctl.store.rowread import RowReader

    _, url = _built(tmp_path, bucket, "carry", 40)  # shards of 24 rows: two
    ds = batchctl.open(url)
    options = {"endpoint_url": s3_endpoint}
    group = zarr.open_group(url, mode="r", storage_options=options)
    images = np.concatenate([ds[i]["image"] for i in range(len(ds))])
    assert np.array_equal(RowReader(url, dict(group.arrays()), options).rows("image", 3, 37), images[3:37])
    fs, gone = _fs(s3_endpoint), f"{bucket}/carry.zarr/image/c/1/0/0/0"
    assert fs.exists(gone)
    fs.rm(gone)
    assert not np.asarray(group["image"][30:34]).any()  # zarr-python: zeros, no error
    with pytest.raises(batchctl.FormatError, match=r"image/c/1/0/0/0 is missing"):
        RowReader(url, dict(group.arrays()), options).rows("image", 30, 34)


def test_a_table_in_a_bucket_builds_the_objects_it_names_and_an_edited_row_alone(
    bucket: str, s3_endpoint: str, tmp_path: Path
) -> None:
    """`batchctl build s3://bucket/data/train.csv`: its rows name objects beside it (and one an
    s3:// URL elsewhere); the workers fetch them; the dataset goes beside the table."""
    fs = _fs(s3_endpoint)
    for i in range(6):
        local = tmp_path / f"a{i}.npy"
        np.save(local, np.full(3, i, np.float32))
        fs.put(str(local), f"{bucket}/data/x/a{i}.npy" if i < 5 else f"{bucket}/elsewhere/a{i}.npy")
    lines = ["file_name,kind,score", *(f"x/a{i}.npy,{'ab'[i % 2]},{i / 2}" for i in range(5))]
    lines += [f"s3://{bucket}/elsewhere/a5.npy,b,2.5", "x/gone.npy,a,1"]
    fs.pipe(f"{bucket}/data/train.csv", ("\n".join(lines) + "\n").encode())
    source, report = f"s3://{bucket}/data/train.csv", tmp_path / "r.json"
    args = ["build", source, "--preprocess", "npy", "--batch-size", "4", "--workers", "2", "--label", "kind"]
    result = run_cli(*args, "--report", report)
    assert result.returncode == 0, result.stderr
    ds = batchctl.open(f"s3://{bucket}/data/train.zarr")
    rows = {
        str(s): (a.tolist(), int(k), float(v))
        for b in ds
        for s, a, k, v in zip(b["source"], b["array"], b["label"], b["score"], strict=True)
    }
    want = {f"x/a{i}.npy": ([float(i)] * 3, i % 2, i / 2) for i in range(5)}
    assert rows == {**want, f"s3://{bucket}/elsewhere/a5.npy": ([5.0] * 3, 1, 2.5)} and ds.classes == ["a", "b"]
    assert {e["source"]: e["error"] for e in json.loads(report.read_text())["errors"]} == {
        "train.csv:8": "names x/gone.npy, which is not there"
    }
    assert "up to date" in run_cli(*args).stderr
    fs.pipe(f"{bucket}/data/train.csv", ("\n".join(lines).replace("x/a3.npy,b,1.5", "x/a3.npy,b,9.0") + "\n").encode())
    edited = run_cli(*args, "--report", report)
    assert edited.returncode == 0, edited.stderr
    data = json.loads(report.read_text())
    assert data["processed"] == 1 and data["changed"]["paths"] == ["x/a3.npy"]
