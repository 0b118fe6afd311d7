"""Ranks as processes, with torchrun's environment, each reading one epoch through a DataLoader.

`run_ranks` starts `world` processes (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE set as
torchrun sets them; a node is a group of ranks with its own cache folder) and returns what each
read: its batches' `source` paths in order and the bytes its processes read, as the kernel
counts them (`rchar` of /proc/PID/io, taken in each DataLoader worker around its pass, after the
dataset is opened). Used by the tests and by `benchmarks/read.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def bytes_read() -> int:
    """What this process (every thread) has read so far, as the kernel counts it."""
    return int(next(line for line in Path("/proc/self/io").read_text().splitlines() if line.startswith("rchar"))[7:])


def _rank_main(path: str, workers: int, options: dict[str, Any], open_options: dict[str, Any]) -> dict[str, Any]:
    """One rank: an epoch of `IterableBatches` through a DataLoader of `workers` workers."""
    from torch.utils.data import DataLoader

    from batchctl.torch import IterableBatches

    class Counted(IterableBatches):
        """Yields, after its share of the epoch, the bytes this process read during it."""

        def __iter__(self) -> Iterator[dict[str, Any]]:
            # before counting: the dataset opened (its metadata read), and a batch of its small
            # fields read, so that the modules NumPy imports on first use (their files) are not counted
            dataset = self._lazy.dataset
            self._loader()
            warm = dataset.loader(mix=4, fields=[name for name in dataset.fields if name in ("label", "source")])
            next(iter(warm))
            before = bytes_read()
            yield from super().__iter__()
            yield {"read": bytes_read() - before}

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    stream = Counted(path, rank=rank, world_size=world, **options, **open_options)
    sources: list[str] = []
    read = 0
    for batch in DataLoader(stream, batch_size=None, num_workers=workers):
        if "read" in batch:
            read += int(batch["read"])
        else:
            sources.extend(batch["source"])
    return {"rank": rank, "sources": sources, "read": read}


def run_ranks(
    path: str | os.PathLike[str],
    world: int,
    workers: int,
    options: dict[str, Any],
    nodes: int = 1,
    cache_root: Path | None = None,
    timeout: float = 300,
) -> list[dict[str, Any]]:
    """Run `world` ranks over `nodes` simulated nodes (a cache folder each under `cache_root` when given)."""
    per_node = world // nodes
    procs = []
    for rank in range(world):
        node = rank // per_node
        cache = {} if cache_root is None else {"cache_dir": str(cache_root / f"node{node}"), "cache_limit": "1GB"}
        env = {
            **os.environ,
            **{"RANK": str(rank), "WORLD_SIZE": str(world)},
            **{"LOCAL_RANK": str(rank % per_node), "LOCAL_WORLD_SIZE": str(per_node)},
        }
        arg = json.dumps([os.fspath(path), workers, options, cache])
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.ranks", arg],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
                env=env,
            )
        )
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def stored_bytes(path: Path, fields: list[str] | None = None) -> int:
    """The bytes of a local dataset's shard files (of `fields` only, when given)."""
    arrays = [p for p in path.iterdir() if p.is_dir() and (fields is None or p.name in fields)]
    return sum(f.stat().st_size for a in arrays for f in (a / "c").rglob("*") if f.is_file())


if __name__ == "__main__":
    print(json.dumps(_rank_main(*json.loads(sys.argv[1]))))
