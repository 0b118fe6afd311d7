"""Training reads from an object store: a moto S3 server on loopback, reached through a relay
that holds every request 20 ms (a far-away bucket). Counted at the server: the data bytes and
requests of a first epoch (against the dataset's stored bytes), of a second epoch with a full
local cache, and of one batch. Timed: stored batches per second with 1, 8 and 32 reads in flight,
the default loader, and LitData's StreamingDataset reading its `optimize()` of the same arrays
from the same server through the same relay (benchmarks/read_peers.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import batchctl
from batchctl.synthetic import make_image_folder

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the tests' S3 server and relay
from tests.s3server import data_gets, range_bytes, requests_made, s3_environment, start_moto, start_relay  # noqa: E402

LATENCY_S = 0.020
PORT = 5391


def bench_remote(root: Path, results: dict[str, Any], build_cmd: Callable[..., list[str]], images: int = 4096) -> None:
    server = start_moto(PORT, root)
    endpoint = f"http://127.0.0.1:{PORT}"
    relays = {latency: start_relay(PORT, latency) for latency in (LATENCY_S, 0.0)}
    try:
        with s3_environment(AWS_ENDPOINT_URL=endpoint):
            far = {latency: address for latency, (_, address) in relays.items()}
            results["remote"] = _measure(root, build_cmd, endpoint, far, images)
    finally:
        for relay, _ in relays.values():
            relay.kill()
        server.terminate()
        server.wait(timeout=10)


def _measure(
    root: Path, build_cmd: Callable[..., list[str]], endpoint: str, relays: dict[float, str], images: int
) -> dict[str, Any]:
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=endpoint)
    fs.mkdir("bench")
    src = root / "remote-images"
    make_image_folder(src, images, sides=(80, 160))
    url = "s3://bench/remote.zarr"
    # the build writes straight to the server (not through a relay, which delays every chunk).
    # Shards of 4 batches (3 MB): moto copies a whole object, under a lock, for every GET, ranged
    # or not (moto/s3/models.py, FakeKey.value), so a ranged read of one batch from the default
    # one-shard 50 MB object costs it ~26 ms; S3 reads only the range
    layout = ("--batch-size", "64", "--shard-batches", "4", "--resize", "64", "--crop", "64")
    subprocess.run(build_cmd(src, url, *layout), check=True)
    stored = sum(fs.size(p) for p in fs.find("bench/remote.zarr") if "/c/" in p)
    far = {"endpoint_url": relays[LATENCY_S]}
    figures: dict[str, Any] = {"latency_ms": LATENCY_S * 1000, "samples": images, "stored_bytes": stored}

    cache = root / "remote-cache"
    with requests_made(endpoint) as first:
        _epoch(batchctl.open(url, storage_options=far, cache_dir=cache, cache_limit="10GB"))
    with requests_made(endpoint) as second:
        _epoch(batchctl.open(url, storage_options=far, cache_dir=cache, cache_limit="10GB"))
    ds = batchctl.open(url, storage_options=far)
    with requests_made(endpoint) as one:
        ds[len(ds) // 2]
    fetched = sum(range_bytes(r) or 0 for r in data_gets(first))
    figures.update(
        first_epoch_data_gets=len(data_gets(first)),
        first_epoch_fetched_vs_stored=round(fetched / stored, 4),
        whole_object_gets=sum(range_bytes(r) is None for r in data_gets(first)),
        second_epoch_data_gets=len(data_gets(second)),
        one_batch_gets=len(data_gets(one)),
        one_batch_fields=len(ds.fields),
    )

    figures.update(_rates(url, relays, "", len(ds)))
    seconds = _timed(lambda: batchctl.open(url, storage_options=far), lambda ds: _epoch(ds))
    figures["loader_default_images_s"] = round(images / seconds, 1)
    figures.update(_litdata(root, url, relays[LATENCY_S], images, figures["loader_default_images_s"]))

    # small batches (12 KiB of images each) in shards too big to fetch whole: a request's time is
    # its latency, not its bytes
    small = "s3://bench/small.zarr"
    layout = ("--batch-size", "64", "--shard-batches", "32", "--resize", "8", "--crop", "8")
    subprocess.run(build_cmd(src, small, *layout), check=True)
    figures.update(_rates(small, relays, "small_", len(batchctl.open(small))))
    return figures


def _rates(url: str, relays: dict[float, str], prefix: str, batches: int) -> dict[str, Any]:
    """Stored batches per second in a shuffled epoch (mix=1) with 1, 8 and 32 in flight, and
    with 8 and no added latency: the server's and this machine's own ceiling."""
    figures: dict[str, Any] = {}
    for latency, prefetch in ((LATENCY_S, 1), (LATENCY_S, 8), (LATENCY_S, 32), (0.0, 8)):
        options = {"endpoint_url": relays[latency]}
        seconds = _timed(
            lambda o=options: batchctl.open(url, storage_options=o),
            lambda ds, p=prefetch: _epoch(ds, mix=1, prefetch=p),
        )
        name = f"{prefix}prefetch_{prefetch}_batches_s" if latency else f"{prefix}no_latency_prefetch_8_batches_s"
        figures[name] = round(batches / seconds, 1)
    figures[f"{prefix}prefetch_8_vs_1"] = round(
        figures[f"{prefix}prefetch_8_batches_s"] / figures[f"{prefix}prefetch_1_batches_s"], 2
    )
    return figures


def _epoch(ds: batchctl.Dataset, **options: Any) -> None:
    for batch in ds.loader(**options):
        batch["image"]


def _timed(opened: Callable[[], batchctl.Dataset], epoch: Callable[[batchctl.Dataset], None], repeat: int = 2) -> float:
    """The best of `repeat` epochs, each of a dataset opened afresh (no index or shard kept) and
    timed from its first read (opening takes several requests, each paying the latency)."""
    best = float("inf")
    for _ in range(repeat):
        ds = opened()
        start = time.perf_counter()
        epoch(ds)
        best = min(best, time.perf_counter() - start)
    return best


def _litdata(root: Path, url: str, far: str, images: int, ours: float) -> dict[str, Any]:
    """LitData's StreamingDataset on the same arrays in the same bucket, through the same relay."""
    try:
        import litdata  # noqa: F401
        import s3fs
    except ImportError:
        print("[info] LitData is missing: its remote figure is left out")
        return {}
    script = str(HERE / "read_peers.py")
    local = root / "remote-litdata"
    ds = batchctl.open(url)
    mirror = root / "remote-mirror.zarr"  # optimize() reads batchctl's arrays from local disk
    s3fs.S3FileSystem().get(url.removeprefix("s3://"), str(mirror), recursive=True)
    subprocess.run([sys.executable, script, "litdata-optimize", str(mirror), str(local), "2"], check=True)
    s3fs.S3FileSystem().put(str(local), "bench/litdata", recursive=True)
    chunks = len(json.loads((local / "index.json").read_text())["chunks"])
    cache = root / "litdata-cache"
    done = subprocess.run(
        [sys.executable, script, "litdata-remote", "s3://bench/litdata", str(cache), str(ds.batch_size)],
        capture_output=True,
        text=True,
        env={**os.environ, "AWS_ENDPOINT_URL": far},
    )
    line = [w for w in done.stdout.splitlines() if w.startswith("RATE")]
    if not line:
        print(f"[info] LitData from the bucket failed: {done.stderr.strip()[-800:]}")
        return {"litdata_chunks": chunks}
    theirs = float(line[0].split()[1])
    return {"litdata_chunks": chunks, "litdata_images_s": round(theirs, 1), "vs_litdata": round(ours / theirs, 2)}
