"""Each byte read once per node, on 2,560 class-sorted photos stored raw (40 stored
batches of 64, 224x224x3): bytes read in one epoch against the stored bytes, counted by the
kernel (`rchar` of /proc/PID/io over every rank and DataLoader worker; tests/ranks.py runs the
ranks as processes with torchrun's environment) for (ranks, workers) = (1,0), (1,2), (4,0),
(4,2), (8,4); `IterableBatches` with 2 DataLoader workers against none, bare and with a CPU
augmentation (benchmarks/read_peers.py); and one loader (world 1, no workers) against np.load
of one .npy per stored batch followed by crc32c of its bytes (the same bytes read and checked,
in a shuffled batch order). Then a mixture's figures: a 0.7/0.3 mixture of it and a second set
against one loader over the first alone, and the bytes a 10% subset and `fields=["label"]` read
against a full epoch's."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import batchctl
from batchctl.store.crc import crc32c

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the tests' ranks runner
from tests.ranks import run_ranks, stored_bytes  # noqa: E402

TOPOLOGIES = ((1, 0), (1, 2), (4, 0), (4, 2), (8, 4))


def bench_read_once(root: Path, results: dict[str, Any], build_cmd: Callable[..., list[str]]) -> None:
    from read import make_photos

    src, originals = root / "once-images", root / "once-photos"
    make_photos(originals, src, 320, 8)  # 2,560 images
    out = root / "once.zarr"
    subprocess.run(build_cmd(src, out, "--batch-size", "64", "--sorted", "--compression", "none"), check=True)
    stored = stored_bytes(out)
    figures: dict[str, Any] = {"samples": batchctl.open(out).num_samples, "stored_bytes": stored}
    options = {"batch_size": 64, "mix": 16, "seed": 0}
    for world, workers in TOPOLOGIES:
        start = time.perf_counter()
        ranks = run_ranks(out, world, workers, options, timeout=900)
        figures[f"ranks_{world}_workers_{workers}"] = {
            "read_vs_stored": round(sum(r["read"] for r in ranks) / stored, 3),
            "rows": sum(len(r["sources"]) for r in ranks),
            "distinct_rows": len({s for r in ranks for s in r["sources"]}),
            "seconds": round(time.perf_counter() - start, 1),
        }
    figures.update(_workers_speed(out))
    figures.update(_against_np_load_crc(root, out))
    results["read_once"] = figures
    results["mixtures_and_views"] = _mixtures_and_views(root, out, build_cmd)


def _mixtures_and_views(root: Path, first: Path, build_cmd: Callable[..., list[str]]) -> dict[str, Any]:
    from read import make_photos

    src, originals = root / "mix-images", root / "mix-photos"
    make_photos(originals, src, 160, 8)  # 1,280 images
    second = root / "second.zarr"
    subprocess.run(build_cmd(src, second, "--batch-size", "64", "--compression", "none"), check=True)
    a, b = batchctl.open(first), batchctl.open(second)

    def rate(make: Callable[[], Any]) -> float:
        best = 0.0
        for _ in range(3):
            loader = make()
            start, rows = time.perf_counter(), 0
            for batch in loader:
                rows += len(batch["image"])
            best = max(best, rows / (time.perf_counter() - start))
        return best

    fields = ["image", "label"]
    alone = rate(lambda: a.loader(batch_size=64, mix=16, fields=fields))
    mixed_loader = batchctl.mix({"a": a, "b": b}, {"a": 0.7, "b": 0.3}, batch_size=64, mix=16, fields=fields)
    proportions = {tuple(np.bincount(batch["dataset"], minlength=2)) for batch in mixed_loader}
    mixed = rate(lambda: batchctl.mix({"a": a, "b": b}, {"a": 0.7, "b": 0.3}, batch_size=64, mix=16, fields=fields))
    full = _bytes_of(lambda: list(a.loader(batch_size=64)))
    labels = [str(c) for c in a.classes or []]
    tenth = a.subset(rows=np.arange(a.num_samples) % 10 == 0)  # rows spread over every stored batch
    one_class = a.subset(labels=labels[:1])  # a sorted build: the class's stored batches only
    return {
        "alone_images_s": round(alone, 1),
        "mixture_0.7_0.3_images_s": round(mixed, 1),
        "mixture_vs_alone": round(mixed / alone, 3),
        "mixture_rows_per_batch": sorted(list(map(int, p)) for p in proportions),
        "subset_every_10th_row_bytes_vs_full": round(_bytes_of(lambda: list(tenth.loader(batch_size=64))) / full, 3),
        "subset_one_class_of_10_bytes_vs_full": round(
            _bytes_of(lambda: list(one_class.loader(batch_size=64))) / full, 3
        ),
        "fields_label_bytes_vs_full": round(
            _bytes_of(lambda: list(a.loader(batch_size=64, fields=["label"]))) / full, 4
        ),
    }


def _consume(batches: Any) -> None:
    """Take each batch and let it go, as a training loop does (a list of them would hold every
    batch: fresh pages for each, measured 0.47x of what the loader does)."""
    for batch in batches:
        batch["image"]


def _bytes_of(run: Callable[[], Any]) -> int:
    from tests.ranks import bytes_read

    before = bytes_read()
    run()
    return bytes_read() - before


def _workers_speed(dataset: Path, rounds: int = 9) -> dict[str, Any]:
    """`IterableBatches` through a DataLoader with 2 workers against none, in one process, an
    epoch of each in turn (`read_peers.py batchctl-side-by-side`): the medians of each one's
    epochs and of the rounds' ratios, bare and with a CPU augmentation."""
    script = str(HERE / "read_peers.py")
    rates: dict[str, Any] = {}
    for mode, extra in (("batchctl", []), ("batchctl-augment", ["augment"])):
        done = subprocess.run(
            [sys.executable, script, "batchctl-side-by-side", str(dataset), "2", "64", str(rounds), *extra],
            capture_output=True,
            text=True,
        )
        line = [w for w in done.stdout.split("\n") if w.startswith("SIDE")]
        if not line:
            print(f"[info] {mode} side by side failed: {done.stderr.strip()[-500:]}")
            continue
        bare, two, ratio = (float(v) for v in line[0].split()[1:])
        rates[f"{mode}_0_workers_images_s"] = round(bare, 1)
        rates[f"{mode}_2_workers_images_s"] = round(two, 1)
        rates[f"{mode}_2_workers_vs_0"] = round(ratio, 2)
    return rates


def _against_np_load_crc(root: Path, dataset: Path) -> dict[str, Any]:
    """One loader (world 1, no workers) at mix 16 and 1 against np.load + crc32c per stored batch,
    and against the same reads and checks into 16 buffers in turn (a group's output batches)."""
    ds = batchctl.open(dataset)
    folder = root / "once-npy"
    folder.mkdir(exist_ok=True)
    files = []
    for i in np.random.default_rng(0).permutation(len(ds)).tolist():
        files.append(folder / f"{i}.npy")
        np.save(files[-1], ds.read_field("image", i))

    def plain() -> None:
        for f in files:
            crc32c(np.load(f))

    # the same reads into buffers in turn, as many as a group of mix=16 fills together: np.load's
    # one buffer, freed and taken again, stays in the CPU's cache (L3) from one batch to the next
    places = [(int(m.offset), m.nbytes) for m in (np.load(f, mmap_mode="r") for f in files)]  # past each header
    rotating = [np.empty(max(n for _, n in places), np.uint8) for _ in range(16)]

    def into_rotating() -> None:
        for k, (f, (offset, nbytes)) in enumerate(zip(files, places, strict=True)):
            into = rotating[k % len(rotating)][:nbytes]
            with open(f, "rb") as file:
                file.seek(offset)
                file.readinto(into.data)
            crc32c(into)

    def best(fn: Callable[[], Any], repeat: int = 3) -> float:
        os.sync()
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    baseline = best(plain)
    figures: dict[str, Any] = {"np_load_crc_images_s": round(ds.num_samples / baseline, 1)}
    figures["read_crc_into_16_buffers_images_s"] = round(ds.num_samples / best(into_rotating), 1)
    for mix in (16, 1):
        seconds = best(lambda mix=mix: _consume(ds.loader(mix=mix, fields=["image", "label"])))
        rows = ds.num_samples // ds.batch_size * ds.batch_size
        figures[f"loader_mix_{mix}_images_s"] = round(rows / seconds, 1)
        figures[f"loader_mix_{mix}_vs_np_load_crc"] = round((rows / seconds) / (ds.num_samples / baseline), 3)
    figures["loader_mix_16_vs_16_buffers"] = round(
        figures["loader_mix_16_images_s"] / figures["read_crc_into_16_buffers_images_s"], 3
    )
    return figures
