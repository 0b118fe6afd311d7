"""What a torchdata `StatefulDataLoader` state says about where a rank is (torchdata 0.11's layout,
which is its own and may change: read here alone, and tested against the real StatefulDataLoader).

A multi-process loader's state is `{"_snapshot": {"_snapshot_step", "_main_snapshot": {...,
"_num_workers"}, "_worker_snapshots": {"worker_0": {"dataset_state": ...}, ...}},
"_steps_since_snapshot", "_iterator_finished"}`; a single-process one's holds `_num_yielded` and
`dataset_state` at its top. `dataset_state` is `IterableBatches.state_dict()`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def saved_num_workers(state: Mapping[str, Any]) -> int | None:
    """The `num_workers` a state was saved with, or None when it does not say (left to torchdata)."""
    snapshot = state.get("_snapshot")
    if isinstance(snapshot, Mapping):
        main = snapshot.get("_main_snapshot")
        workers = main.get("_num_workers") if isinstance(main, Mapping) else None
        return workers if isinstance(workers, int) else None
    return 0 if "_num_yielded" in state else None


def stream_states(state: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The stream's own state in each worker (or in the single process), in worker order."""
    snapshot = state.get("_snapshot")
    if isinstance(snapshot, Mapping):
        workers = snapshot.get("_worker_snapshots")
        if not isinstance(workers, Mapping):
            return []
        found = [workers.get(f"worker_{i}") for i in range(len(workers))]
        states = [w.get("dataset_state") if isinstance(w, Mapping) else None for w in found]
    else:
        states = [state.get("dataset_state")]
    return [s for s in states if isinstance(s, Mapping)] if all(isinstance(s, Mapping) for s in states) else []


def rank_steps(state: Mapping[str, Any]) -> int | None:
    """The batches the rank has had from the DataLoader's current iterator (all its workers':
    the DataLoader hands them out in turn), or None when the state does not say."""
    snapshot = state.get("_snapshot")
    if isinstance(snapshot, Mapping):
        step, since = snapshot.get("_snapshot_step"), state.get("_steps_since_snapshot", 0)
        return step + since if isinstance(step, int) and isinstance(since, int) else None
    found = state.get("_num_yielded")
    return found if isinstance(found, int) else None


def finished(state: Mapping[str, Any]) -> bool:
    """The iterator the state was taken from had handed out its whole pass."""
    return bool(state.get("_iterator_finished", False))
