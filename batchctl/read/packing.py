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

from collections.abc import Iterator

import numpy as np

from batchctl.errors import UsageError
from batchctl.read.tokens import TokenLoader, TokenSource


class PackedLoader(TokenLoader):
    """This rank's packed batches of `batch_size` blocks of `block` tokens, epoch after epoch;
    `state_dict`/`load_state_dict` resume exactly on the same number of ranks."""

    KIND = "packed blocks"
    STATE_FORMAT = "batchctl-packed/1"

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
        options = {"block": block, "batch_size": batch_size, "seed": seed, "shuffle": shuffle, "mix": mix}
        super().__init__(
            dataset, field, rank, world_size, {"block": block, "batch_size": batch_size, "mix": mix}, options
        )
        self.with_rows = rows
        tokens = sum(int(lengths.sum()) for lengths in self.lengths)
        if tokens // world_size < block:
            raise UsageError(
                f"{dataset.path} holds {tokens} tokens: too few for a block of {block} on each of {world_size} ranks"
            )

    # the epoch's layout ------------------------------------------------------------------------

    def _stretch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, int, int]:
        """The epoch's stored-batch order, where each starts in the stream, and this rank's
        tokens [first, first + blocks x block)."""
        order = self._order(epoch)
        sizes = np.array([int(self.lengths[i].sum()) for i in order], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(sizes)])
        share = int(starts[-1]) // self.world_size
        blocks = share // int(self.options["block"])
        return order, starts, self.rank * share, blocks

    def _steps(self, epoch: int) -> int:
        blocks = self._stretch(epoch)[3]
        return -(-blocks // int(self.options["batch_size"]))

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
