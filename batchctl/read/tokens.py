"""What the readers of a ragged token field share (`packing.PackedLoader`, blocks cut from the
documents end to end; `budget.BudgetLoader`, whole rows under a token budget): the dataset they
read, its options' checks, each stored batch's row lengths, the epoch's stored-batch order, and
a resume state of (epoch, step) on the same number of ranks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from batchctl.errors import ResumeMismatchError, UsageError


class TokenSource(Protocol):
    """What they read: `batchctl.Dataset` (reader.py imports this module, not the reverse)."""

    path: str
    build_id: str
    batch_size: int

    @property
    def ragged(self) -> Mapping[str, Any]: ...

    @property
    def fields(self) -> dict[str, tuple[tuple[int, ...], np.dtype[Any]]]: ...

    def __len__(self) -> int: ...

    def read_batch(self, index: int, into: Any = None, fields: list[str] | None = None) -> dict[str, Any]: ...

    def ragged_batch(self, name: str, index: int) -> tuple[np.ndarray, np.ndarray]: ...


class TokenLoader:
    """A rank's batches of a ragged token field, epoch after epoch, resumable at any step. A
    subclass says what it makes (`KIND`, its state's `STATE_FORMAT`) and how many steps an epoch
    has for this rank (`_steps`)."""

    KIND = ""  # "packed blocks": for messages
    STATE_FORMAT = ""

    def __init__(
        self,
        dataset: TokenSource,
        field: str,
        rank: int,
        world_size: int,
        counts: Mapping[str, int],
        options: dict[str, Any],
    ) -> None:
        for name, value in {**counts, "world_size": world_size}.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{self.KIND} need {name} >= 1, got {value!r}")
        if not 0 <= rank < world_size:
            raise UsageError(f"rank {rank} is not one of world_size {world_size}'s ranks")
        if field not in dataset.ragged or dataset.fields[field][0] != (-1,):
            raise UsageError(
                f"{dataset.path} has no ragged field {field!r} of rows (n,) for {self.KIND} "
                f"(its fields: {', '.join(dataset.fields)})"
            )
        self.dataset, self.field, self.rank, self.world_size = dataset, field, rank, world_size
        self.options = options
        # each stored batch's rows' lengths, read once (its offsets alone: 16 bytes a row)
        self.lengths = [offsets[:, 1] - offsets[:, 0] for offsets in _offsets(dataset, field)]
        self.epoch, self.step = 0, 0

    def _steps(self, epoch: int) -> int:
        raise NotImplementedError

    def _rng(self, epoch: int, *more: int) -> np.random.Generator:
        return np.random.default_rng([int(self.options["seed"]), epoch, *more])

    def _order(self, epoch: int) -> np.ndarray:
        """The epoch's stored batches, in a seeded order (as stored without `shuffle`)."""
        count = len(self.lengths)
        return self._rng(epoch).permutation(count) if self.options["shuffle"] else np.arange(count)

    def __len__(self) -> int:
        """This rank's steps left in the current epoch."""
        return max(self._steps(self.epoch) - self.step, 0)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.step = int(epoch), 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": self.STATE_FORMAT,
            "build_id": self.dataset.build_id,
            "options": {**self.options, "field": self.field},
            "world_size": self.world_size,
            "epoch": self.epoch,
            "step": self.step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("format") != self.STATE_FORMAT:
            raise ResumeMismatchError(f"not a state of {self.KIND} (expected format {self.STATE_FORMAT!r})")
        if state.get("build_id") != self.dataset.build_id:
            raise ResumeMismatchError(f"the state is of another version of {self.dataset.path} (it was rebuilt since)")
        mine = {**self.options, "field": self.field}
        if state.get("options") != mine:
            raise ResumeMismatchError(
                f"the state was saved with the options {state.get('options')}, this loader has {mine}"
            )
        if state.get("world_size") != self.world_size:
            raise ResumeMismatchError(
                f"the state was saved on {state.get('world_size')} ranks, this is {self.world_size}: {self.KIND} "
                "resume on the same number of ranks"
            )
        epoch, step = state.get("epoch"), state.get("step")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (epoch, step)):
            raise ResumeMismatchError(f"the state's epoch and step are not ints >= 0: {epoch!r}, {step!r}")
        assert isinstance(epoch, int) and isinstance(step, int)
        if step > self._steps(epoch):
            raise ResumeMismatchError(f"the state's step {step} is past its epoch's {self._steps(epoch)} steps")
        self.epoch, self.step = epoch, step


def _offsets(dataset: TokenSource, field: str) -> list[np.ndarray]:
    """Each stored batch's `[start, stop)` rows of a ragged field (its offsets array alone)."""
    name = f"{field}.offsets"
    found = []
    for index in range(len(dataset)):
        offsets = np.asarray(dataset.read_batch(index, fields=[name])[name], dtype=np.int64)
        found.append(offsets.reshape(-1, 2))
    return found
