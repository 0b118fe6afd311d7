"""The Zarr v3 metadata documents (`zarr.json`) of a batchctl dataset, as plain JSON.

A build writes its arrays without zarr-python: importing it costs ~0.2 s in every process that
does, twice on a build's critical path (the parent and the collator), several times a small
build's whole work. What is written here is what zarr-python 3.1 writes for the same arrays
(tests/test_transport.py compares the documents), and zarr-python, tensorstore and zarrs read it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from batchctl.errors import FormatError
from batchctl.store import storage
from batchctl.store.untrusted import open_regular, parse_json, read_regular

ZARR_JSON = "zarr.json"
STORED_KINDS = "biuf"  # booleans, integers and floats: the core Zarr v3 data types batchctl stores


@dataclass(frozen=True)
class ArrayMeta:
    """One array's `zarr.json`: its name in the group, shape, data type, chunk grid (the shard
    shape, when sharded) and codecs, plus the rest kept as read."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # the Zarr v3 data type, which for the core types is NumPy's name
    grid: tuple[int, ...]  # the regular chunk grid's chunk shape: a shard's shape when sharded
    codecs: tuple[dict[str, Any], ...]
    fill_value: Any = 0
    separator: str = "/"
    key_prefix: bool = True  # the `default` chunk key encoding ("c/0/0"); `v2` has none ("0/0")
    dimension_names: tuple[str, ...] | None = None
    attributes: dict[str, Any] = field(default_factory=dict)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def sharding(self) -> dict[str, Any] | None:
        """The `sharding_indexed` codec's configuration, when that is the array's one codec."""
        if len(self.codecs) == 1 and self.codecs[0].get("name") == "sharding_indexed":
            return dict(self.codecs[0].get("configuration") or {})
        return None

    @property
    def chunks(self) -> tuple[int, ...]:
        """The shape of one chunk (one batch): inside a shard when sharded."""
        sharding = self.sharding
        return tuple(int(n) for n in sharding["chunk_shape"]) if sharding else self.grid

    @property
    def shards(self) -> tuple[int, ...] | None:
        return self.grid if self.sharding else None

    @property
    def chunks_per_shard(self) -> int:
        """Chunks in one shard, its index's entries: a batch each, or (a ragged field's values)
        the chunks each batch's values may span, times the batches."""
        return int(np.prod([g // c for g, c in zip(self.grid, self.chunks, strict=True)]))

    def chunk_key(self, coords: Sequence[int]) -> str:
        """The key of the grid cell (a shard, when sharded) at `coords`, relative to the array."""
        parts = [str(int(c)) for c in coords] or ["0"]
        return self.separator.join(["c", *parts] if self.key_prefix else parts)

    def shard_key(self, shard: int) -> str:
        """The key of shard `shard` (rows `shard * shard_rows` on), relative to the dataset."""
        return f"{self.name}/{self.chunk_key((shard,) + (0,) * (self.ndim - 1))}"

    def resized(self, rows: int) -> ArrayMeta:
        return replace(self, shape=(rows, *self.shape[1:]))

    def to_json(self) -> dict[str, Any]:
        """The document, with zarr-python's keys in zarr-python's order."""
        encoding = "default" if self.key_prefix else "v2"
        doc: dict[str, Any] = {
            "shape": list(self.shape),
            "data_type": self.dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(self.grid)}},
            "chunk_key_encoding": {"name": encoding, "configuration": {"separator": self.separator}},
            "fill_value": self.fill_value,
            "codecs": [dict(codec) for codec in self.codecs],
            "attributes": dict(self.attributes),
        }
        if self.dimension_names is not None:
            doc["dimension_names"] = list(self.dimension_names)
        doc.update({"zarr_format": 3, "node_type": "array", "storage_transformers": []})
        return doc

    @classmethod
    def from_json(cls, name: str, doc: Mapping[str, Any]) -> ArrayMeta:
        """Parse an array's document; one that is not a Zarr v3 array with a regular chunk grid
        and a default or v2 chunk key encoding is refused (`FormatError`)."""
        try:
            if doc.get("zarr_format") != 3 or doc.get("node_type") != "array":
                raise ValueError("not a Zarr v3 array")
            grid = doc["chunk_grid"]
            if grid["name"] != "regular":
                raise ValueError(f"chunk grid {grid['name']!r}")
            encoding = doc.get("chunk_key_encoding") or {"name": "default"}
            if encoding["name"] not in ("default", "v2"):
                raise ValueError(f"chunk key encoding {encoding['name']!r}")
            dtype = doc["data_type"]
            if not isinstance(dtype, str):
                raise ValueError(f"data type {dtype!r}")
            default_separator = "/" if encoding["name"] == "default" else "."
            names = doc.get("dimension_names")
            return cls(
                name=name,
                shape=tuple(int(n) for n in doc["shape"]),
                dtype=dtype,
                grid=tuple(int(n) for n in grid["configuration"]["chunk_shape"]),
                codecs=tuple(doc["codecs"]),
                fill_value=doc.get("fill_value", 0),
                separator=(encoding.get("configuration") or {}).get("separator", default_separator),
                key_prefix=encoding["name"] == "default",
                dimension_names=None if names is None else tuple(names),
                attributes=dict(doc.get("attributes") or {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"{name}/{ZARR_JSON} is damaged or not a batchctl array ({exc})") from None

    @classmethod
    def of_zarr(cls, arr: Any) -> ArrayMeta:
        """The document of an array zarr-python opened (a reader goes through zarr for a URL)."""
        return cls.from_json(str(arr.path), json.loads(json.dumps(arr.metadata.to_dict())))

    @classmethod
    def sharded(
        cls,
        name: str,
        row_shape: tuple[int, ...],
        dtype: str,
        chunk_rows: int,
        shard_rows: int,
        compressors: list[dict[str, Any]],
        dimension_names: Sequence[str],
        chunk_row_shape: tuple[int, ...] | None = None,
    ) -> ArrayMeta:
        """An empty array (no rows yet) chunked by `chunk_rows` rows and sharded by `shard_rows`,
        its chunks' codecs `bytes` then `compressors`, the shard index checked by crc32c: what
        zarr-python's `create_array(..., shards=...)` writes. A chunk spans whole rows unless
        `chunk_row_shape` says less (a ragged field's values)."""
        kind = np.dtype(dtype)
        if kind.kind not in STORED_KINDS or not kind.isnative:
            raise FormatError(
                f"field {name!r} has data type {kind}: batchctl stores integers, floats and booleans only"
            )
        as_bytes: dict[str, Any] = {"name": "bytes"}
        if kind.itemsize > 1:
            as_bytes["configuration"] = {"endian": "little"}
        inner = [as_bytes, *(_with_typesize(codec, kind.itemsize) for codec in compressors)]
        sharding = {
            "name": "sharding_indexed",
            "configuration": {
                "chunk_shape": [chunk_rows, *(row_shape if chunk_row_shape is None else chunk_row_shape)],
                "codecs": inner,
                "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                "index_location": "end",
            },
        }
        return cls(
            name=name,
            shape=(0, *row_shape),
            dtype=kind.name,
            grid=(shard_rows, *row_shape),
            codecs=(sharding,),
            fill_value=False if kind.kind == "b" else 0.0 if kind.kind == "f" else 0,
            dimension_names=tuple(dimension_names),
        )


def _with_typesize(codec: dict[str, Any], itemsize: int) -> dict[str, Any]:
    """blosc's configuration names the item size first, as zarr-python completes it."""
    if codec["name"] != "blosc":
        return codec
    return {"name": "blosc", "configuration": {"typesize": itemsize, **codec["configuration"]}}


def group_json(attributes: Mapping[str, Any], arrays: Mapping[str, ArrayMeta] | None = None) -> dict[str, Any]:
    """A group's document, as zarr-python writes it; with `arrays`, their documents consolidated
    in it as `zarr.consolidate_metadata` writes them (xarray and zarr open the group in one read)."""
    doc: dict[str, Any] = {"attributes": dict(attributes), "zarr_format": 3}
    if arrays is not None:
        doc["consolidated_metadata"] = {
            "kind": "inline",
            "must_understand": False,
            "metadata": {name: meta.to_json() for name, meta in sorted(arrays.items())},
        }
    doc["node_type"] = "group"
    return doc


def encode(doc: Mapping[str, Any]) -> bytes:
    """A document's bytes (zarr-python's indentation)."""
    return json.dumps(doc, indent=2).encode()


@dataclass(frozen=True)
class DatasetFiles:
    """A dataset's objects by key (files under a folder, or objects under a URL), read and written
    without zarr-python. Every write is atomic: a local file is written aside and renamed into
    place (readers never see a torn one, as with zarr's LocalStore), an object is one PUT."""

    location: str
    storage_options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def remote(self) -> bool:
        return storage.is_url(self.location)

    def read(self, key: str) -> bytes:
        """The object `key`; FileNotFoundError when there is none. A local one is read only if it
        is a regular file of a document's size (`untrusted.read_regular`)."""
        if self.remote:
            fs, root = storage.locate(self.location, self.storage_options)
            return bytes(fs.cat_file(f"{root}/{key}"))
        return read_regular(Path(self.location) / key)

    def write(self, key: str, pieces: Sequence[Any]) -> None:
        if self.remote:
            fs, root = storage.locate(self.location, self.storage_options)
            fs.pipe_file(f"{root}/{key}", b"".join(bytes(piece) for piece in pieces))
            return
        path = Path(self.location) / key
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
        try:
            with tmp.open("wb") as file:
                file.writelines(pieces)
            tmp.replace(path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def read_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes `start:end` of the object `key` (a local one read only if a regular file)."""
        if self.remote:
            fs, root = storage.locate(self.location, self.storage_options)
            return bytes(fs.cat_file(f"{root}/{key}", start=start, end=end))
        with open_regular(Path(self.location) / key) as file:
            return os.pread(file.fileno(), end - start, start)

    def size(self, key: str) -> int:
        """The bytes of the object `key`, or -1 when there is none."""
        if self.remote:
            fs, root = storage.locate(self.location, self.storage_options)
            return int(fs.size(f"{root}/{key}")) if fs.exists(f"{root}/{key}") else -1
        try:
            return os.stat(Path(self.location) / key).st_size
        except FileNotFoundError:
            return -1

    def listdir(self, prefix: str) -> list[str]:
        """The names directly under the folder (or prefix) `prefix`; none when there is none."""
        if self.remote:
            fs, root = storage.locate(self.location, self.storage_options)
            where = f"{root}/{prefix}"
            listed = fs.ls(where, detail=False) if fs.isdir(where) else []
            return [name.rstrip("/").rsplit("/", 1)[-1] for name in listed]
        try:
            return os.listdir(Path(self.location) / prefix)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def remove(self, keys: Sequence[str]) -> None:
        """The objects or folders `keys`, with everything under them."""
        if not keys:
            return
        if self.remote:
            fs, root = storage.locate(self.location, self.storage_options)
            fs.rm([f"{root}/{key}" for key in keys], recursive=True)
            return
        for key in keys:
            path = Path(self.location) / key
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)

    def create_group(self, attributes: Mapping[str, Any]) -> None:
        """A new, empty group with these attributes in place of whatever was at the location."""
        if self.remote:
            fs, root = storage.locate(self.location, self.storage_options)
            if fs.exists(root):
                fs.rm(root, recursive=True)
        else:
            shutil.rmtree(self.location, ignore_errors=True)
            Path(self.location).mkdir(parents=True)
        self.write(ZARR_JSON, [encode(group_json(attributes))])

    def group_attributes(self) -> dict[str, Any]:
        doc = parse_json(self.read(ZARR_JSON))
        if not isinstance(doc, dict) or doc.get("node_type") != "group":
            raise FormatError(f"{self.location}/{ZARR_JSON} is not a Zarr group's")
        return dict(doc.get("attributes") or {})

    def update_group_attributes(
        self, attributes: Mapping[str, Any], arrays: Mapping[str, ArrayMeta] | None = None
    ) -> None:
        """The group's attributes with these keys replaced (as zarr's `group.attrs.update`), and
        with `arrays`, their documents consolidated in it."""
        self.write(ZARR_JSON, [encode(group_json({**self.group_attributes(), **attributes}, arrays))])

    def write_array(self, meta: ArrayMeta) -> None:
        self.write(f"{meta.name}/{ZARR_JSON}", [encode(meta.to_json())])

    def arrays(self) -> dict[str, ArrayMeta]:
        """Every array of the group, by name: the folders (or prefixes) holding an array's document."""
        found = {}
        for name in self._children():
            try:
                doc = parse_json(self.read(f"{name}/{ZARR_JSON}"))
            except (FileNotFoundError, NotADirectoryError):  # a file such as the record: not an array
                continue
            except ValueError as exc:
                raise FormatError(f"{self.location}: {name}/{ZARR_JSON} is damaged ({exc})") from None
            if isinstance(doc, dict) and doc.get("node_type") == "array":
                found[name] = ArrayMeta.from_json(name, doc)
        return found

    def _children(self) -> list[str]:
        if self.remote:
            fs, root = storage.locate(self.location, self.storage_options)
            listed = fs.ls(root, detail=True) if fs.exists(root) else []
            folders = [entry["name"] for entry in listed if entry["type"] == "directory"]
            return sorted(name.rstrip("/").rsplit("/", 1)[-1] for name in folders)
        try:
            return sorted(entry.name for entry in os.scandir(self.location) if entry.is_dir())
        except FileNotFoundError:
            return []
