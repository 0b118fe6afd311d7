"""`.txt` documents as token ids: each file (or, `column=NAME`, each row of a table SOURCE's
column of text) one document, one sample, its ragged field `tokens` (rows of `(n,)`). Ids come
from a local Hugging Face `tokenizer.json` (`--option tokenizer=PATH`, through the `tokenizers`
package: nothing is downloaded), or are the UTF-8 bytes without one. The end-of-text id is
appended when the tokenizer has one (`eos=auto`), or the one given (`eos=ID`), or none
(`eos=none`). uint16 when the vocabulary fits, else uint32. The tokenizer file's SHA-256 is one
of the options a dataset records: another tokenizer is another dataset."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from batchctl.errors import UsageError
from batchctl.preprocess.base import Preprocessor

# what a tokenizer's end of text is called, in the files the hub's tokenizers come as
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[EOS]")
UINT16_IDS = 2**16


def preprocess_text(
    path: Path, tokenizer: str = "", eos: str = "auto", tokenizer_sha256: str = "", column: str = ""
) -> dict[str, np.ndarray]:
    """One document's token ids (the end-of-text id last, where there is one). (`column`, a table
    SOURCE's column of documents, is the build's: each row's document arrives as a file.)"""
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    if not text:
        raise ValueError("an empty document")
    end = _eos_id(tokenizer, tokenizer_sha256, eos)
    if tokenizer:
        ids = _tokenizer(tokenizer, tokenizer_sha256).encode(text, add_special_tokens=False).ids
        found = np.asarray(ids, dtype=_dtype(tokenizer, tokenizer_sha256))
    else:
        found = np.frombuffer(raw, np.uint8).astype(np.uint16)
    if end is not None:
        found = np.append(found, np.asarray(end, found.dtype))
    return {"tokens": found}


@functools.cache
def _tokenizer(path: str, sha256: str) -> Any:
    """The tokenizer, loaded once per process (its hash in the key: a worker never uses a stale one)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


@functools.cache  # (once per process, not per document)
def _dtype(path: str, sha256: str) -> type[np.unsignedinteger[Any]]:
    return np.uint16 if _tokenizer(path, sha256).get_vocab_size(with_added_tokens=True) <= UINT16_IDS else np.uint32


@functools.cache  # (the vocabulary is a dict made afresh by each get_vocab: once per process)
def _eos_id(path: str, sha256: str, eos: str) -> int | None:
    if eos == "none":
        return None
    if eos != "auto":
        return int(eos)
    if not path:
        return None
    vocab = _tokenizer(path, sha256).get_vocab(with_added_tokens=True)
    return next((vocab[name] for name in EOS_NAMES if name in vocab), None)


def check_options(options: Mapping[str, Any]) -> None:
    """The tokenizer can be loaded (here, before any work) and `eos` is auto, none or an id."""
    eos = options["eos"]
    if eos not in ("auto", "none") and not (isinstance(eos, str) and eos.isdigit()):
        raise UsageError(f"Expected --option eos=auto, none or a token id, got {eos!r} instead.")
    path = options["tokenizer"]
    if not path:
        if eos not in ("auto", "none") and int(eos) > 255:
            raise UsageError(f"--option eos={eos}: without a tokenizer the ids are bytes, 0 to 255")
        return
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise UsageError("--option tokenizer needs the tokenizers package: pip install 'batchctl[text]'") from None
    try:
        loaded = _tokenizer(path, _sha256(path))
    except OSError as exc:
        raise UsageError(f"--option tokenizer={path}: {exc.strerror or exc}") from None
    except Exception as exc:  # noqa: BLE001 - tokenizers raises its own kinds for a broken file
        raise UsageError(f"--option tokenizer={path} is not a tokenizer.json tokenizers can load: {exc}") from None
    if eos not in ("auto", "none") and int(eos) >= loaded.get_vocab_size(with_added_tokens=True):
        raise UsageError(f"--option eos={eos} is not an id of {path} ({loaded.get_vocab_size()} ids)")


def relevant(options: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """The options with the tokenizer file's hash: a dataset records it, so another tokenizer
    (or the same file edited) is another dataset, whatever its path."""
    path = options["tokenizer"]
    return {**options, "tokenizer_sha256": _sha256(path) if path else ""}


def _sha256(path: str) -> str:
    try:
        with open(path, "rb") as file:
            return hashlib.file_digest(file, "sha256").hexdigest()
    except OSError as exc:
        raise UsageError(f"--option tokenizer={path}: {exc.strerror or exc}") from None


def describe(options: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    kind = "ids of the tokenizer with SHA-256 " + options["tokenizer_sha256"] if options["tokenizer"] else "UTF-8 bytes"
    return {"tokens": {"dimension_names": ["token"], "attributes": {"meaning": f"a document's tokens: {kind}"}}}


PREPROCESSOR = Preprocessor(
    name="text",
    code="text/1",  # raise when the output for the same file and options changes
    fn=preprocess_text,
    extensions=(".txt",),
    defaults={"tokenizer": "", "eos": "auto", "tokenizer_sha256": "", "column": ""},
    check=check_options,
    relevant=relevant,
    describe=describe,
    ragged=("tokens",),
)
