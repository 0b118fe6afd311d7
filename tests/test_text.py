"""`--preprocess text`: .txt documents as a ragged `tokens` field, from a BPE trained here
(`tokenizers`' own trainer: nothing downloaded) or as UTF-8 bytes. The real CLI on real files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import batchctl
from tests.conftest import run_cli

tokenizers = pytest.importorskip("tokenizers")

WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "über", "naïve", "日本"]
TEXT = ["--preprocess", "text", "--batch-size", "4", "--workers", "2"]


def corpus(folder: Path, count: int) -> dict[str, str]:
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    documents = {}
    for i in range(count):
        text = " ".join(rng.choice(WORDS, size=int(rng.integers(3, 40))))
        (folder / f"d{i:02d}.txt").write_text(text, encoding="utf-8")
        documents[f"d{i:02d}.txt"] = text
    return documents


def train_bpe(path: Path, documents: list[str], vocab: int = 300) -> tokenizers.Tokenizer:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["[UNK]", "<|endoftext|>"])
    tokenizer.train_from_iterator(documents, trainer)
    tokenizer.save(str(path))
    return tokenizer


def tokens_of(out: Path) -> dict[str, list[int]]:
    found = {}
    for batch in batchctl.open(out):
        for source, row in zip(batch["source"], batch["tokens"], strict=True):
            found[str(source)] = np.asarray(row).tolist()
    return found


def test_documents_become_the_tokenizers_ids_with_its_end_of_text_and_another_tokenizer_rebuilds(
    tmp_path: Path,
) -> None:
    documents = corpus(tmp_path / "docs", 12)
    tokenizer = train_bpe(tmp_path / "tok.json", list(documents.values()))
    eos = tokenizer.token_to_id("<|endoftext|>")
    out, report = tmp_path / "o.zarr", tmp_path / "r.json"
    args = ["build", tmp_path / "docs", "-o", out, *TEXT, "--option", f"tokenizer={tmp_path / 'tok.json'}"]
    result = run_cli(*args, "--report", report)
    assert result.returncode == 0, result.stderr
    want = {name: [*tokenizer.encode(text, add_special_tokens=False).ids, eos] for name, text in documents.items()}
    assert tokens_of(out) == want
    ds = batchctl.open(out)
    assert ds.fields["tokens"][1] == np.dtype("uint16")  # 300 ids fit
    assert "up to date" in run_cli(*args).stderr
    train_bpe(
        tmp_path / "tok.json", list(documents.values()), vocab=40
    )  # the same path, another tokenizer (fewer merges)
    again = run_cli(*args, "--report", report)
    assert again.returncode == 0, again.stderr
    assert json.loads(report.read_text())["processed"] == 12  # all of it, with the new ids
    retrained = tokenizers.Tokenizer.from_file(str(tmp_path / "tok.json"))
    ids = retrained.encode(documents["d03.txt"], add_special_tokens=False).ids
    assert tokens_of(out)["d03.txt"] == [*ids, eos] and ids != want["d03.txt"][:-1]
    no_eos = tmp_path / "n.zarr"
    assert run_cli(*args[:3], no_eos, *args[4:], "--option", "eos=none").returncode == 0
    assert tokens_of(no_eos)["d03.txt"] == ids


def test_without_a_tokenizer_the_tokens_are_utf8_bytes_and_bad_documents_are_one_skip_each(tmp_path: Path) -> None:
    documents = corpus(tmp_path / "docs", 5)
    (tmp_path / "docs" / "empty.txt").write_bytes(b"")
    (tmp_path / "docs" / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    out, report = tmp_path / "o.zarr", tmp_path / "r.json"
    result = run_cli("build", tmp_path / "docs", "-o", out, *TEXT, "--report", report)
    assert result.returncode == 0, result.stderr
    assert tokens_of(out) == {name: list(text.encode()) for name, text in documents.items()}
    errors = {e["source"]: e["error"] for e in json.loads(report.read_text())["errors"]}
    assert errors == {
        "empty.txt": "ValueError: an empty document",
        "latin1.txt": "ValueError: not UTF-8 text (byte 3); save it as UTF-8",
    }


@pytest.mark.parametrize(
    ("option", "said"),
    [
        ("tokenizer=missing.json", "--option tokenizer=missing.json: No such file or directory"),
        ("tokenizer=BROKEN", "is not a tokenizer.json tokenizers can load"),
        ("eos=end", "Expected --option eos=auto, none or a token id"),
        ("eos=300", "without a tokenizer the ids are bytes"),
    ],
)
def test_a_missing_or_broken_tokenizer_or_a_bad_eos_is_one_usage_error(tmp_path: Path, option: str, said: str) -> None:
    corpus(tmp_path / "docs", 2)
    (tmp_path / "broken.json").write_text('{"not": "a tokenizer"}')
    option = option.replace("BROKEN", str(tmp_path / "broken.json"))
    result = run_cli("build", tmp_path / "docs", "-o", tmp_path / "o.zarr", *TEXT, "--option", option)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], result.stderr


@pytest.mark.parametrize("form", ["jsonl", "csv", "parquet"])
def test_a_table_of_documents_one_a_row_and_an_edited_row_rebuilds_alone(tmp_path: Path, form: str) -> None:
    """An LLM corpus as a table (`text` and other columns, no files): `--option column=text`;
    source is TABLE:LINE, the other columns fields; a row without text is one skip."""
    documents = list(corpus(tmp_path / "unused", 8).values())
    documents[2] = "123"  # (a CSV cell that reads as a number: a document all the same)
    rows = [{"id": i, "text": text} for i, text in enumerate(documents)] + [{"id": 99, "text": ""}]
    table = tmp_path / f"corpus.{form}"

    def write(rows: list[dict[str, object]]) -> None:
        if form == "jsonl":
            table.write_text("".join(json.dumps(row) + "\n" for row in rows))
        elif form == "csv":
            table.write_text("id,text\n" + "".join(f"{row['id']},{row['text']}\n" for row in rows))
        else:
            pa = pytest.importorskip("pyarrow")
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(rows), table, row_group_size=3)

    write(rows)
    out, report = tmp_path / "o.zarr", tmp_path / "r.json"
    args = ["build", table, "-o", out, *TEXT, "--option", "column=text", "--report", report]
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr
    found = {}
    for batch in batchctl.open(out):
        for source, ident, row in zip(batch["source"], batch["id"], batch["tokens"], strict=True):
            found[str(source)] = (int(ident), bytes(np.asarray(row, np.uint8)).decode())
    first = 2 if form == "csv" else 1  # (a CSV's line 1 is its header; a Parquet's rows count from 1)
    assert found == {f"corpus.{form}:{first + i}": (i, text) for i, text in enumerate(documents)}
    assert [e["error"] for e in json.loads(report.read_text())["errors"]] == ["no text in its 'text' column"]
    rows[5] = {"id": 5, "text": "an edited document"}
    write(rows)
    edited = run_cli(*args)
    assert edited.returncode == 0, edited.stderr
    data = json.loads(report.read_text())
    assert data["processed"] == 1 and len(data["changed"]["paths"]) == 1
    texts = {bytes(np.asarray(row, np.uint8)).decode() for batch in batchctl.open(out) for row in batch["tokens"]}
    assert "an edited document" in texts and documents[5] not in texts


def test_a_column_of_documents_in_a_folder_is_one_usage_error(tmp_path: Path) -> None:
    corpus(tmp_path / "docs", 2)
    result = run_cli("build", tmp_path / "docs", "-o", tmp_path / "o.zarr", *TEXT, "--option", "column=text")
    assert result.returncode == 2 and "names a column of documents in a table SOURCE" in result.stderr


@pytest.fixture(scope="module")
def byte_corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    """40 documents of 5-300 bytes, built as UTF-8 byte tokens in batches of 4."""
    root = tmp_path_factory.mktemp("packed")
    rng = np.random.default_rng(7)
    documents = {}
    for i in range(40):
        data = bytes(rng.integers(97, 123, size=int(rng.integers(5, 300))).astype(np.uint8))
        (root / "docs").mkdir(exist_ok=True)
        (root / "docs" / f"d{i:02d}.txt").write_bytes(data)
        documents[f"d{i:02d}.txt"] = data
    out = root / "docs.zarr"
    assert run_cli("build", root / "docs", "-o", out, *TEXT, "--sorted").returncode == 0
    return out, documents


def packed_epoch(out: Path, **options: object) -> list[dict[str, np.ndarray]]:
    loader = batchctl.open(out).packed(rows=True, **options)  # type: ignore[arg-type]
    return list(loader)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_packed_blocks_give_each_token_once_with_its_place_and_under_a_block_left_out_per_rank(
    byte_corpus: tuple[Path, dict[str, bytes]], world: int
) -> None:
    out, documents = byte_corpus
    ds = batchctl.open(out)
    sources = [str(s) for batch in ds for s in batch["source"]]  # row -> document (a --sorted build)
    total = sum(len(d) for d in documents.values())
    seen: set[tuple[int, int]] = set()
    steps = set()
    for rank in range(world):
        batches = packed_epoch(out, block=16, batch_size=4, seed=3, rank=rank, world_size=world, mix=2)
        steps.add(len(batches))
        for batch in batches:
            assert batch["tokens"].shape[1] == 16 and batch["tokens"].dtype == np.uint16
            for tokens, positions, rows in zip(batch["tokens"], batch["positions"], batch["rows"], strict=True):
                for token, position, row in zip(tokens, positions, rows, strict=True):
                    assert documents[sources[row]][position] == token  # the token is its document's byte there
                    assert (row, position) not in seen  # no token twice in an epoch, over all ranks
                    seen.add((row, position))
    assert len(steps) == 1  # equal steps on every rank
    assert total - len(seen) < world * 16  # under one block left out per rank
    starts = [b["positions"] for b in packed_epoch(out, block=16, batch_size=4, seed=3)]
    assert any((p == 0).any() for p in starts)  # documents begin inside blocks: positions start again


def test_packed_blocks_change_every_epoch_and_resume_exactly(byte_corpus: tuple[Path, dict[str, bytes]]) -> None:
    out, _ = byte_corpus
    ds = batchctl.open(out)
    loader = ds.packed(block=16, batch_size=4, seed=1, mix=2)
    first, second = [b["tokens"].tolist() for b in loader], [b["tokens"].tolist() for b in loader]
    assert first != second and len(first) == len(second)
    again = ds.packed(block=16, batch_size=4, seed=1, mix=2)
    assert [b["tokens"].tolist() for b in again] == first  # the same seed, the same epoch
    whole = first + second
    for stop in (1, 5, len(first) - 1, len(first) + 3):
        loader = ds.packed(block=16, batch_size=4, seed=1, mix=2)
        got = []
        while len(got) < stop:
            for batch in loader:
                got.append(batch["tokens"].tolist())
                if len(got) == stop:
                    break
        state = json.loads(json.dumps(loader.state_dict()))
        resumed = ds.packed(block=16, batch_size=4, seed=1, mix=2)
        resumed.load_state_dict(state)
        while len(got) < len(whole):
            got += [b["tokens"].tolist() for b in resumed]
        assert got == whole, stop
    with pytest.raises(batchctl.ResumeMismatchError, match="resume on the same number of ranks"):
        ds.packed(block=16, batch_size=4, seed=1, mix=2, world_size=2).load_state_dict(state)
    with pytest.raises(batchctl.UsageError, match="no ragged field 'label'"):
        ds.packed(block=16, batch_size=4, field="label")


@pytest.mark.parametrize("padded", [False, True], ids=["tokens", "padded size"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_batches_by_a_token_budget_hold_whole_rows_under_it_each_row_once(
    byte_corpus: tuple[Path, dict[str, bytes]], padded: bool, world: int
) -> None:
    out, documents = byte_corpus
    ds = batchctl.open(out)
    sources = [str(s) for batch in ds for s in batch["source"]]
    seen: list[int] = []
    steps = set()
    for rank in range(world):
        loader = ds.budgeted(max_tokens=600, padded=padded, window=3, seed=2, rank=rank, world_size=world)
        batches = list(loader)
        steps.add(len(batches))
        assert loader.left_out == 0
        for batch in batches:
            lengths = batch["tokens_lengths"]
            assert (lengths.max() * len(lengths) if padded else lengths.sum()) <= 600
            for tokens, length, row in zip(batch["tokens"], lengths, batch["rows"], strict=True):
                assert bytes(tokens[:length].astype(np.uint8)) == documents[sources[row]] and not tokens[length:].any()
            seen += batch["rows"].tolist()
    assert len(steps) == 1  # equal steps on every rank
    assert sorted(seen) == list(range(len(documents)))  # every row once an epoch


def test_a_token_budget_changes_with_the_epoch_resumes_exactly_and_refuses_a_longer_row(
    byte_corpus: tuple[Path, dict[str, bytes]],
) -> None:
    out, _ = byte_corpus
    ds = batchctl.open(out)
    loader = ds.budgeted(max_tokens=600, window=3, seed=5)
    first, second = [b["rows"].tolist() for b in loader], [b["rows"].tolist() for b in loader]
    assert first != second and sorted(sum(first, [])) == sorted(sum(second, []))
    for stop in (1, len(first) // 2, len(first)):
        loader = ds.budgeted(max_tokens=600, window=3, seed=5)
        head = [b["rows"].tolist() for _, b in zip(range(stop), loader, strict=False)]
        resumed = ds.budgeted(max_tokens=600, window=3, seed=5)
        resumed.load_state_dict(json.loads(json.dumps(loader.state_dict())))
        assert head + [b["rows"].tolist() for b in resumed] == first, stop
        assert [b["rows"].tolist() for b in resumed] == second  # and on into the next epoch
    with pytest.raises(batchctl.UsageError, match=r"has \d+ tokens, more than max_tokens=100: raise the budget"):
        ds.budgeted(max_tokens=100)
    cut = ds.budgeted(max_tokens=100, truncate=True)
    assert all(b["tokens"].shape[1] <= 100 for b in cut)
