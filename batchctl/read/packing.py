"""Packed blocks for language models: fixed-length blocks of a ragged token field (the text
preprocessor's `tokens`), cut from the documents laid end to end in an order that changes every
epoch, as nanoGPT's `train.bin` or LitData's `TokensLoader` are read.

The epoch's stream: the stored batches in a seeded order, each one's documents as stored (a
build dispatches its files in a seeded order already), end to end. Each consumer (rank) takes
one contiguous stretch of `floor(T / world)` of its T tokens, so each stored batch is read by at
most two consumers, and cuts it into blocks of `block` tokens: what is left out is less than one
block per consumer, and every consumer has the same number of steps. Blocks are shuffled within
groups of `mix` output batches (their stored batches are read once per group). Each batch gives
`tokens` (B, block) and `positions` (B, block), each token's place in its document (0 where one
starts), so attention can be kept within documents; `rows` (each token's document, as its
dataset row) on request.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import numpy as np

from batchctl.errors import ResumeMismatchError, UsageError


class TokenSource(Protocol):
    """What packed blocks and token budgets read: `batchctl.Dataset` (reader.py imports this
    module, not the reverse)."""

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


STATE_FORMAT = "batchctl-packed/1"


class PackedLoader:
    """This rank's packed batches of `batch_size` blocks of `block` tokens, epoch after epoch;
    `state_dict`/`load_state_dict` resume exactly on the same number of ranks."""

    def __init__(
        self,
        dataset: TokenSource,
        block: int,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        mix: int = 16,
        rank: int = 0,
        world_size: int = 1,
        field: str = "tokens",
        rows: bool = False,
    ) -> None:
        for name, value in (("block", block), ("batch_size", batch_size), ("mix", mix), ("world_size", world_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"packed blocks need {name} >= 1, got {value!r}")
        if not 0 <= rank < world_size:
            raise UsageError(f"rank {rank} is not one of world_size {world_size}'s ranks")
        if field not in dataset.ragged or dataset.fields[field][0] != (-1,):
            raise UsageError(
                f"{dataset.path} has no ragged field {field!r} of rows (n,) to pack "
                f"(its fields: {', '.join(dataset.fields)})"
            )
        self.dataset, self.field = dataset, field
        self.options = {"block": block, "batch_size": batch_size, "seed": seed, "shuffle": shuffle, "mix": mix}
        self.rank, self.world_size, self.with_rows = rank, world_size, rows
        # each stored batch's documents' lengths, read once (its offsets alone: 16 bytes a document)
        self.lengths = [offsets[:, 1] - offsets[:, 0] for offsets in metadata_offsets(dataset, field)]
        self.epoch, self.step = 0, 0
        tokens = sum(int(lengths.sum()) for lengths in self.lengths)
        if tokens // world_size < block:
            raise UsageError(
                f"{dataset.path} holds {tokens} tokens: too few for a block of {block} on each of {world_size} ranks"
            )

    # the epoch's layout ------------------------------------------------------------------------

    def _rng(self, epoch: int, *more: int) -> np.random.Generator:
        return np.random.default_rng([self.options["seed"], epoch, *more])

    def _order(self, epoch: int) -> np.ndarray:
        count = len(self.lengths)
        return self._rng(epoch).permutation(count) if self.options["shuffle"] else np.arange(count)

    def _stretch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, int, int]:
        """The epoch's stored-batch order, where each starts in the stream, and this rank's
        tokens [first, first + blocks x block)."""
        order = self._order(epoch)
        sizes = np.array([int(self.lengths[i].sum()) for i in order], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(sizes)])
        share = int(starts[-1]) // self.world_size
        blocks = share // self.options["block"]
        return order, starts, self.rank * share, blocks

    def __len__(self) -> int:
        """This rank's steps left in the current epoch."""
        return max(self._steps(self.epoch) - self.step, 0)

    def _steps(self, epoch: int) -> int:
        blocks = self._stretch(epoch)[3]
        return -(-blocks // self.options["batch_size"])

    # reading -------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        """The rest of the current epoch; then the next epoch is the current one."""
        epoch, block, size, mix = self.epoch, self.options["block"], self.options["batch_size"], self.options["mix"]
        order, starts, first, blocks = self._stretch(epoch)
        steps = -(-blocks // size)
        group_blocks = mix * size
        while self.step < steps:
            group = self.step // mix
            lo, hi = group * group_blocks, min((group + 1) * group_blocks, blocks)
            tokens, positions, rows = self._read(order, starts, first + lo * block, first + hi * block, epoch)
            shape = (hi - lo, block)
            picked = (
                self._rng(epoch, 2, self.rank, group).permutation(hi - lo)
                if self.options["shuffle"]
                else np.arange(hi - lo)
            )
            tokens, positions = tokens.reshape(shape)[picked], positions.reshape(shape)[picked]
            rows = rows.reshape(shape)[picked] if self.with_rows else rows
            for step in range(self.step - group * mix, -(-(hi - lo) // size)):
                part = slice(step * size, (step + 1) * size)
                batch = {"tokens": tokens[part], "positions": positions[part]}
                if self.with_rows:
                    batch["rows"] = rows[part]
                self.step = group * mix + step + 1
                yield batch
        self.epoch, self.step = epoch + 1, 0

    def _read(
        self, order: np.ndarray, starts: np.ndarray, lo: int, hi: int, epoch: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The stream's tokens [lo, hi), their places in their documents and their rows."""
        first = int(np.searchsorted(starts, lo, side="right")) - 1
        last = int(np.searchsorted(starts, hi, side="left"))
        pieces: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for place in range(first, last):
            stored = int(order[place])
            offsets, tokens = self.dataset.ragged_batch(self.field, stored)  # (its rows lie end to end from 0)
            begin = max(lo - int(starts[place]), 0)
            end = min(hi, int(starts[place + 1])) - int(starts[place])
            # the documents [first_doc, last_doc) that hold tokens [begin, end), and how many of them each
            first_doc = int(np.searchsorted(offsets[:, 1], begin, side="right"))
            last_doc = int(np.searchsorted(offsets[:, 0], end, side="left"))
            starts_of = offsets[first_doc:last_doc, 0]
            taken = np.minimum(offsets[first_doc:last_doc, 1], end) - np.maximum(starts_of, begin)
            positions = np.arange(begin, end, dtype=np.int64) - np.repeat(starts_of, taken)
            rows = np.empty(0, np.int64)
            if self.with_rows:
                documents = np.arange(first_doc, last_doc, dtype=np.int64) + stored * self.dataset.batch_size
                rows = np.repeat(documents, taken)
            pieces.append((tokens[begin:end], positions, rows))
        joined = tuple(np.concatenate([piece[k] for piece in pieces]) for k in range(3))
        return joined  # type: ignore[return-value]  # (rows: empty unless asked for)

    # resuming ------------------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.step = int(epoch), 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT,
            "build_id": self.dataset.build_id,
            "options": {**self.options, "field": self.field},
            "world_size": self.world_size,
            "epoch": self.epoch,
            "step": self.step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ResumeMismatchError(f"not a packed loader's state (expected format {STATE_FORMAT!r})")
        if state.get("build_id") != self.dataset.build_id:
            raise ResumeMismatchError(f"the state is of another version of {self.dataset.path} (it was rebuilt since)")
        mine = {**self.options, "field": self.field}
        if state.get("options") != mine:
            raise ResumeMismatchError(
                f"the state was saved with the options {state.get('options')}, this loader has {mine}"
            )
        if state.get("world_size") != self.world_size:
            raise ResumeMismatchError(
                f"the state was saved on {state.get('world_size')} ranks, this is {self.world_size}: packed blocks "
                "resume on the same number of ranks"
            )
        epoch, step = state.get("epoch"), state.get("step")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (epoch, step)):
            raise ResumeMismatchError(f"the state's epoch and step are not ints >= 0: {epoch!r}, {step!r}")
        assert isinstance(epoch, int) and isinstance(step, int)
        if step > self._steps(epoch):
            raise ResumeMismatchError(f"the state's step {step} is past its epoch's {self._steps(epoch)} steps")
        self.epoch, self.step = epoch, step


def metadata_offsets(dataset: TokenSource, field: str) -> list[np.ndarray]:
    """Each stored batch's `[start, stop)` rows of a ragged field (its offsets array alone)."""
    name = f"{field}.offsets"
    found = []
    for index in range(len(dataset)):
        offsets = np.asarray(dataset.read_batch(index, fields=[name])[name], dtype=np.int64)
        found.append(offsets.reshape(-1, 2))
    return found
