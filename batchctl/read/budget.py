"""Batches by a token budget, as fairseq's `--max-tokens`: whole rows of a ragged token field,
as many as fit under `max_tokens`, rows of like length together, so batches of short rows hold
many and batches of long rows few.

An epoch: the stored batches in a seeded order, taken `window` at a time; a window's rows sorted
by length (ties in a seeded order) and cut greedily into batches whose tokens (`padded=False`)
or padded size, rows x the longest (`padded=True`), is at most `max_tokens`; the window's
batches in a seeded order. Rank r of n takes windows r, r + n, ... (each stored batch read by one
rank, once), and ranks with fewer batches split their fullest ones until every rank has as many
steps: every row comes once an epoch (unless a rank's batches are all single rows and cannot be
split: then the others' last ones are left out and counted, `left_out`). A row longer than
`max_tokens` is refused in one line naming it, or cut to the budget with `truncate=True`.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from batchctl.errors import UsageError
from batchctl.read.tokens import TokenLoader, TokenSource

Batch = list[tuple[int, int]]  # (stored batch, row within it) of each row, in order


class BudgetLoader(TokenLoader):
    """This rank's batches of whole rows under a token budget, epoch after epoch: `tokens`
    zero-padded (B, longest) with `tokens_lengths` (B,), and `rows` (each one's dataset row)."""

    KIND = "batches by a token budget"
    STATE_FORMAT = "batchctl-budget/1"

    def __init__(
        self,
        dataset: TokenSource,
        max_tokens: int,
        padded: bool = False,
        window: int = 16,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        field: str = "tokens",
        truncate: bool = False,
    ) -> None:
        options = {"max_tokens": max_tokens, "padded": padded, "window": window, "seed": seed}
        options.update(shuffle=shuffle, truncate=truncate)
        super().__init__(dataset, field, rank, world_size, {"max_tokens": max_tokens, "window": window}, options)
        if len(self.lengths) < world_size:
            raise UsageError(f"{dataset.path} has {len(self.lengths)} stored batches: too few for {world_size} ranks")
        longest = max((int(lengths.max()) for lengths in self.lengths if len(lengths)), default=0)
        if longest > max_tokens and not truncate:
            stored = next(i for i, lengths in enumerate(self.lengths) if len(lengths) and lengths.max() == longest)
            row = stored * dataset.batch_size + int(np.argmax(self.lengths[stored]))
            source = dataset.read_batch(stored, fields=["source"])["source"][int(np.argmax(self.lengths[stored]))]
            raise UsageError(
                f"row {row} ({source}) has {longest} tokens, more than max_tokens={max_tokens}: "
                "raise the budget, or truncate=True cuts such rows to it"
            )
        self.left_out = 0  # rows of the epoch planned last no rank takes (see `_split_to`)
        self._plans: dict[int, list[list[Batch]]] = {}

    # the epoch's plan --------------------------------------------------------------------------

    def _length(self, stored: int, row: int) -> int:
        return min(int(self.lengths[stored][row]), int(self.options["max_tokens"]))

    def _plan(self, epoch: int) -> list[list[Batch]]:
        """Every rank's batches this epoch (made once an epoch: a few ints a row)."""
        if epoch in self._plans:
            return self._plans[epoch]
        count, window = len(self.lengths), int(self.options["window"])
        order = self._order(epoch)
        windows = [order[i : i + window] for i in range(0, count, window)]
        ranks: list[list[Batch]] = [[] for _ in range(self.world_size)]
        for number, stored_batches in enumerate(windows):
            ranks[number % self.world_size].extend(self._window_batches(epoch, number, stored_batches))
        steps = max(len(batches) for batches in ranks)
        for batches in ranks:
            _split_to(batches, steps)
        reached = min(len(batches) for batches in ranks)  # (short of `steps` only where batches were single rows)
        self.left_out = sum(len(batch) for batches in ranks for batch in batches[reached:])
        ranks = [batches[:reached] for batches in ranks]
        self._plans = {epoch: ranks}
        return ranks

    def _window_batches(self, epoch: int, number: int, stored_batches: np.ndarray) -> list[Batch]:
        rows = [(int(s), r) for s in stored_batches for r in range(len(self.lengths[int(s)]))]
        if not rows:
            return []
        lengths = np.array([self._length(s, r) for s, r in rows], dtype=np.int64)
        ties = self._rng(epoch, 1, number).random(len(rows)) if self.options["shuffle"] else np.arange(len(rows))
        budget, padded = int(self.options["max_tokens"]), bool(self.options["padded"])
        batches: list[Batch] = []
        current: Batch = []
        total = longest = 0
        for index in np.lexsort((ties, lengths)):
            length = max(int(lengths[index]), 1)
            grown = (len(current) + 1) * max(longest, length) if padded else total + length
            if current and grown > budget:
                batches.append(current)
                current, total, longest = [], 0, 0
            current.append(rows[index])
            total, longest = total + length, max(longest, length)
        batches.append(current)
        if self.options["shuffle"]:
            batches = [batches[i] for i in self._rng(epoch, 2, number).permutation(len(batches))]
        return batches

    def _steps(self, epoch: int) -> int:
        return len(self._plan(epoch)[self.rank])

    # reading -------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        """The rest of the current epoch; then the next epoch is the current one."""
        epoch = self.epoch
        batches = self._plan(epoch)[self.rank]
        held: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        while self.step < len(batches):
            rows = batches[self.step]
            for stored in {s for s, _ in rows} - held.keys():
                held[stored] = self.dataset.ragged_batch(self.field, stored)
            if len(held) > 4 * int(self.options["window"]):  # (a window's stored batches, and the next few)
                for stored in list(held)[: len(held) - 2 * int(self.options["window"])]:
                    del held[stored]
            self.step += 1
            yield self._batch(rows, held)
        self.epoch, self.step = epoch + 1, 0

    def _batch(self, rows: Batch, held: dict[int, tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
        lengths = np.array([self._length(s, r) for s, r in rows], dtype=np.int64)
        first = held[rows[0][0]][1]
        tokens = np.zeros((len(rows), int(lengths.max(initial=0))), dtype=first.dtype)
        for i, (stored, row) in enumerate(rows):
            offsets, values = held[stored]
            start = int(offsets[row, 0])
            tokens[i, : lengths[i]] = values[start : start + lengths[i]]
        found = np.array([s * self.dataset.batch_size + r for s, r in rows], dtype=np.int64)
        return {"tokens": tokens, f"{self.field}_lengths": lengths, "rows": found}


def _split_to(batches: list[Batch], steps: int) -> None:
    """Split the batches holding the most rows in two until there are `steps` of them (a split
    batch stays under the budget). A rank whose batches are all single rows can split no more:
    the other ranks' last batches are then left out (`left_out`), so that steps stay equal."""
    while len(batches) < steps:
        index = max(range(len(batches)), key=lambda i: len(batches[i]), default=-1)
        if index < 0 or len(batches[index]) < 2:
            return
        rows = batches.pop(index)
        half = len(rows) // 2
        batches[index:index] = [rows[:half], rows[half:]]
