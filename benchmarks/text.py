"""Text for language models, side by side in one run: building a corpus of .txt documents into
token ids with `--preprocess text` against a `multiprocessing.Pool` of as many workers running
the same tokenizer and writing a nanoGPT-style `train.bin` (uint16, documents end to end, each
with its end-of-text id), in tokens/s; then reading an epoch of shuffled packed blocks
(`ds.packed`) against `np.memmap` of that `.bin` sliced at random offsets, in tokens/s.

    python benchmarks/run.py --only text [--documents N]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROUNDS = 3
BLOCK, BATCH = 1024, 8
# common English words, the corpus's vocabulary
WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at"]
WORDS += ["from", "his", "her", "an", "which", "or", "be", "are", "this", "had", "not", "but"]

POOL_JOB = """
import sys, time
from multiprocessing import Pool
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

TOKENIZER = None


def encode(path):
    global TOKENIZER
    if TOKENIZER is None:
        TOKENIZER = Tokenizer.from_file(sys.argv[2])
    ids = TOKENIZER.encode(Path(path).read_text(), add_special_tokens=False).ids
    ids.append(TOKENIZER.token_to_id("<|endoftext|>"))
    return np.asarray(ids, np.uint16)


if __name__ == "__main__":
    files = sorted(str(p) for p in Path(sys.argv[1]).glob("*.txt"))
    with Pool(int(sys.argv[4])) as pool, open(sys.argv[3], "wb") as out:
        for ids in pool.imap(encode, files, chunksize=64):
            out.write(ids.tobytes())
"""


def _corpus(folder: Path, documents: int) -> int:
    """`documents` .txt files of 200-3,000 words, their bytes in all."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    total = 0
    for i in range(documents):
        text = " ".join(rng.choice(WORDS, size=int(rng.integers(200, 3000))).tolist())
        (folder / f"doc{i:06d}.txt").write_text(text)
        total += len(text)
    return total


def _tokenizer(path: Path, folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["[UNK]", "<|endoftext|>"], show_progress=False)
    tokenizer.train([str(p) for p in sorted(folder.glob("*.txt"))[:200]], trainer)
    tokenizer.save(str(path))


def bench_text(
    root: Path,
    documents: int,
    results: dict[str, Any],
    command: Callable[..., list[str]],
    measure: Callable[..., tuple[float, int, Any]],
    workers: int,
) -> None:
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        print("[info] tokenizers is not installed here: the text rows are left out (pip install tokenizers)")
        return
    corpus, tokenizer = root / "corpus", root / "tokenizer.json"
    _corpus(corpus, documents)
    _tokenizer(tokenizer, corpus)
    job = root / "pool_job.py"
    job.write_text(POOL_JOB)
    out, binary = root / "corpus.zarr", root / "train.bin"
    build = command(corpus, out, "--preprocess", "text", "--option", f"tokenizer={tokenizer}", "--batch-size", "64")
    pool = [sys.executable, str(job), str(corpus), str(tokenizer), str(binary), str(workers)]
    times: dict[str, list[float]] = {"batchctl": [], "pool": []}
    for _ in range(ROUNDS):
        times["batchctl"].append(measure(build)[0])
        times["pool"].append(measure(pool)[0])
    tokens = int(np.memmap(binary, np.uint16, mode="r").shape[0])
    build_rates = {name: tokens / statistics.median(found) for name, found in times.items()}
    section: dict[str, Any] = {
        "documents": documents,
        "tokens": tokens,
        "rounds": ROUNDS,
        "build_tokens_per_s": {name: round(rate) for name, rate in build_rates.items()},
        "build_over_pool": round(build_rates["batchctl"] / build_rates["pool"], 3),
    }
    section["read"] = _read(out, binary, tokens)
    results["text"] = section
    print(json.dumps(section, indent=2))


def _read(out: Path, binary: Path, tokens: int) -> dict[str, Any]:
    """An epoch of packed blocks against the same number of random slices of the `.bin`, each
    batch made into one int64 array (as a training step takes it), alternated rounds."""
    import batchctl

    ds = batchctl.open(out)
    rates: dict[str, list[float]] = {"packed": [], "memmap": []}
    blocks = 0
    for _ in range(ROUNDS):
        started = time.perf_counter()
        loader = ds.packed(block=BLOCK, batch_size=BATCH, seed=0)
        blocks = 0
        for batch in loader:
            step = batch["tokens"].astype(np.int64)
            blocks += len(step)
        rates["packed"].append(blocks * BLOCK / (time.perf_counter() - started))
        data = np.memmap(binary, np.uint16, mode="r")
        rng = np.random.default_rng(0)
        started = time.perf_counter()
        for _ in range(-(-blocks // BATCH)):
            starts = rng.integers(0, tokens - BLOCK, size=BATCH)
            step = np.stack([data[s : s + BLOCK] for s in starts]).astype(np.int64)
        rates["memmap"].append(blocks * BLOCK / (time.perf_counter() - started))
    found = {name: round(statistics.median(values)) for name, values in rates.items()}
    return {"tokens_per_s": found, "packed_over_memmap": round(found["packed"] / found["memmap"], 3), "blocks": blocks}
