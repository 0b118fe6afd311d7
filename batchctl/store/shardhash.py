"""How a shard file is hashed (docs/format.md, "The digest"): a tree, so that chunks are hashed
where they are encoded, many at once, and no one thread hashes every byte a build writes.
No imports from batchctl: the journal, the shard writer and the digest all use it."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

SHARD_HASH = "sha256-chunks"  # the scheme a shard hash names, before its hex: `shard_hash`


def chunk_digest(pieces: Iterable[object]) -> bytes:
    """The SHA-256 of one stored chunk's bytes, given as the pieces it is written from."""
    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(memoryview(piece).cast("B"))  # type: ignore[arg-type]
    return digest.digest()


def shard_hash(chunk_digests: Iterable[bytes], index: bytes) -> str:
    """A shard file's hash from its chunks' digests (in index order, missing chunks skipped) and
    its index bytes: `sha256-chunks:` and the SHA-256 of the line `batchctl shard` followed by
    those digests and the index's SHA-256."""
    whole = hashlib.sha256(b"batchctl shard\n")
    for digest in chunk_digests:
        whole.update(digest)
    whole.update(hashlib.sha256(index).digest())
    return f"{SHARD_HASH}:{whole.hexdigest()}"


def ours(found: str) -> bool:
    """A hash of this scheme (an earlier batchctl's whole-file SHA-256 is not used)."""
    return found.startswith(f"{SHARD_HASH}:")


def is_shard_hash(found: str) -> bool:
    """A shard hash of this scheme, or an earlier batchctl's whole-file SHA-256 (64 hex, not used)."""
    return re.fullmatch(rf"({SHARD_HASH}:)?[0-9a-f]{{64}}", found) is not None
