"""Reading: stored batches in order and shuffled, and the training loader at each `mix`, against
np.load of the same bytes from one .npy file (the practical limit on this machine); the loader's
shuffle quality on a class-sorted build against a true global permutation; and one epoch through
a torch DataLoader beside LitData's streaming loader on the same arrays and torchvision decoding
the photos themselves (benchmarks/read_peers.py, each in a process of its own)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import batchctl
from batchctl.read.order import EpochOrder, OrderOptions
from batchctl.synthetic import make_image_folder

HERE = Path(__file__).resolve().parent
CLASSES = tuple(f"class{i}" for i in range(10))
MIXES = (1, 4, 16, 64)


def make_photos(photos: Path, src: Path, count: int, copies: int) -> None:
    """`count` generated photos in 10 class folders under `photos`, and under `src` each of them
    `copies` times (hard links: generating one costs ~14 ms, and the copies make a data set big
    enough for several groups of `mix=64` at a fraction of that)."""
    for path in make_image_folder(photos, count, classes=CLASSES, sides=(260, 400)):
        folder = src / path.parent.name
        folder.mkdir(parents=True, exist_ok=True)
        for n in range(copies):
            os.link(path, folder / f"{path.stem}-{n}{path.suffix}")


def bench_read(
    root: Path, results: dict[str, Any], build_cmd: Callable[..., list[str]], photos: int = 1024, copies: int = 8
) -> None:
    src, originals = root / "read-images", root / "read-photos"
    make_photos(originals, src, photos, copies)
    out = root / "read.zarr"
    # class-sorted rows, the harshest input for a shuffle (each stored batch holds one class or
    # two), and stored raw: the goal's figure is for uncompressed images
    subprocess.run(build_cmd(src, out, "--batch-size", "64", "--sorted", "--compression", "none"), check=True)
    ds = batchctl.open(out)
    whole = np.concatenate([ds[i]["image"] for i in range(len(ds))])
    npy = root / "images.npy"
    np.save(npy, whole)
    nbytes = whole.nbytes

    def rate(fn: Any, repeat: int = 3) -> float:
        # no writeback of the dataset or of images.npy left running under the measurement
        # (without this the first figure measured, sequential, came out 0.63-1.05x of np.load)
        os.sync()
        best = float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        return best

    limit = rate(lambda: np.load(npy))
    results["read"] = _read_rates(ds, nbytes, limit, rate)
    results["loader"] = _loader_table(ds, nbytes, limit, rate)
    results["read_peers"] = _peer_rates(root, out, originals)
    # the default `auto` stores these pixels raw; the same batches with zstd, for what it costs
    packed = root / "read-zstd.zarr"
    subprocess.run(build_cmd(src, packed, "--batch-size", "64", "--compression", "zstd"), check=True)
    results["read_zstd"] = _read_rates(batchctl.open(packed), nbytes, limit, rate)


def _read_rates(ds: batchctl.Dataset, nbytes: int, limit: float, rate: Callable[..., float]) -> dict[str, Any]:
    sequential = rate(lambda: [b["image"] for b in ds.iter_batches(prefetch=2)])
    shuffled = rate(lambda: [b["image"] for b in ds.iter_batches(shuffle=True, seed=1, prefetch=2)])
    return {
        "samples": ds.num_samples,
        "bytes": nbytes,
        "np_load_mb_s": round(nbytes / limit / 1e6, 1),
        "sequential_mb_s": round(nbytes / sequential / 1e6, 1),
        "sequential_samples_s": round(ds.num_samples / sequential, 1),
        "shuffled_mb_s": round(nbytes / shuffled / 1e6, 1),
        "shuffled_samples_s": round(ds.num_samples / shuffled, 1),
        "sequential_vs_np_load": round(limit / sequential, 3),
        "shuffled_vs_np_load": round(limit / shuffled, 3),
    }


def _loader_table(ds: batchctl.Dataset, nbytes: int, limit: float, rate: Callable[..., float]) -> dict[str, Any]:
    """The user's randomness-against-speed table: at each `mix`, an epoch's read rate (each batch
    taken and let go) against np.load of the whole array and against np.load batch by batch
    (`_np_load_per_batch`), the mean number of classes per batch and the fraction of pairs of samples sharing a
    batch that share one again the next epoch, each beside a true global permutation's."""
    labels = np.concatenate([ds.read_field("label", i) for i in range(len(ds))])
    size = ds.batch_size
    rng = np.random.default_rng(0)
    permuted = [rng.permutation(ds.num_samples)[: ds.num_samples // size * size].reshape(-1, size) for _ in range(2)]
    table: dict[str, Any] = {
        "samples": ds.num_samples,
        "batch_size": size,
        "classes": len(set(labels.tolist())),
        "global_permutation": {
            "classes_per_batch": round(_classes_per_batch(labels, permuted[0]), 3),
            "pairs_again": _pairs_again(permuted[0], permuted[1], ds.num_samples),
        },
    }
    per_batch = _np_load_per_batch(ds, rate)
    table["np_load_per_batch_mb_s"] = round(nbytes / per_batch / 1e6, 1)
    for mix in MIXES:
        loader = ds.loader(mix=mix)
        seconds = rate(lambda loader=loader: _consume(loader))
        epochs = [_epoch_rows(ds, mix, epoch) for epoch in (0, 1)]
        table[f"mix_{mix}"] = {
            "mb_s": round(nbytes / seconds / 1e6, 1),
            "images_s": round(ds.num_samples / seconds, 1),
            "vs_np_load": round(limit / seconds, 3),
            "vs_np_load_per_batch": round(per_batch / seconds, 3),
            "classes_per_batch": round(_classes_per_batch(labels, epochs[0]), 3),
            "pairs_again": _pairs_again(epochs[0], epochs[1], ds.num_samples),
        }
    table["memory_mix_16"] = _peak_batches(ds, mix=16)
    return table


def _consume(batches: Any) -> None:
    """Take each batch and let it go, as a training loop does (holding them all would measure
    the allocation of the whole data set instead)."""
    for batch in batches:
        batch["image"]


def _np_load_per_batch(ds: batchctl.Dataset, rate: Callable[..., float]) -> float:
    """np.load of each stored batch's images from a file of its own, in a shuffled order, each
    let go before the next: the same loop on plain files. Its buffer is the previous one's,
    still in the CPU's cache, which a training step that uses the batch would not leave it."""
    folder = Path(ds.path).parent / "per-batch-npy"
    folder.mkdir(exist_ok=True)
    files = []
    for i in np.random.default_rng(0).permutation(len(ds)).tolist():
        files.append(folder / f"{i}.npy")
        np.save(files[-1], ds.read_field("image", i))
    return rate(lambda: _consume({"image": np.load(f)} for f in files))


def _epoch_rows(ds: batchctl.Dataset, mix: int, epoch: int) -> np.ndarray:
    order = EpochOrder(ds.num_samples, ds.batch_size, OrderOptions(ds.batch_size, True, 0, mix, True), epoch)
    return np.stack([order.rows(j) for j in range(order.batches)])


def _classes_per_batch(labels: np.ndarray, batches: np.ndarray) -> float:
    return float(np.mean([len(np.unique(labels[rows])) for rows in batches]))


def _pairs_again(first: np.ndarray, second: np.ndarray, samples: int) -> float:
    """Of the pairs of samples sharing a batch in `second`, the fraction that shared one in `first`."""
    batch_of = np.full(samples, -1)
    batch_of[first.reshape(-1)] = np.repeat(np.arange(len(first)), first.shape[1])
    again = 0
    for rows in second:
        counts = np.unique(batch_of[rows][batch_of[rows] >= 0], return_counts=True)[1]
        again += int((counts * (counts - 1) // 2).sum())
    pairs = len(second) * second.shape[1] * (second.shape[1] - 1) // 2
    return round(again / pairs, 5)


def _peak_batches(ds: batchctl.Dataset, mix: int) -> dict[str, Any]:
    """Peak memory of one epoch's pass (numpy's buffers are traced), in stored batches."""
    stored = sum(ds.read_field(name, 0).nbytes for name in ds.fields)
    loader = ds.loader(mix=mix)
    tracemalloc.start()
    for _batch in loader:
        pass
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {
        "peak_mb": round(peak / 1e6, 1),
        "stored_batches": round(peak / stored, 1),
        "mix": mix,
        "prefetch": loader.prefetch,
    }


def _peer_rates(root: Path, dataset: Path, photos: Path) -> dict[str, Any]:
    """One epoch's images/s through a torch DataLoader with 0 and all-core workers: batchctl's
    IterableBatches, LitData on its `optimize()` of the same arrays, torchvision on the photos."""
    try:
        import litdata  # noqa: F401
    except ImportError:
        print("[info] torch or LitData is missing: the read peers are left out")
        return {}
    script = str(HERE / "read_peers.py")
    cores = len(os.sched_getaffinity(0))
    optimized = root / "read-litdata"
    subprocess.run([sys.executable, script, "litdata-optimize", str(dataset), str(optimized), str(cores)], check=True)
    figures: dict[str, Any] = {}
    for workers in (0, cores):
        for name, source in (("batchctl", dataset), ("litdata", optimized), ("torchvision", photos)):
            done = subprocess.run(
                [sys.executable, script, name, str(source), str(workers), "64"], capture_output=True, text=True
            )
            line = [w for w in done.stdout.split("\n") if w.startswith("RATE")]
            if "STANDIN" in done.stdout:
                figures["torchvision_stand_in"] = "torchvision does not import here: the same work on PIL"
            figures[f"{name}_{workers}_workers_images_s"] = round(float(line[0].split()[1]), 1) if line else None
            if not line:
                print(f"[info] {name} with {workers} workers failed: {done.stderr.strip()[-500:]}")
        ours = figures[f"batchctl_{workers}_workers_images_s"]
        for peer in ("litdata", "torchvision"):
            theirs = figures[f"{peer}_{workers}_workers_images_s"]
            figures[f"vs_{peer}_{workers}_workers"] = round(ours / theirs, 2) if ours and theirs else None
    return figures
