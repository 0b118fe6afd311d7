"""The dataset format's metadata: names, layout rules and the group attributes (docs/format.md).

Plain data and JSON, no zarr: a rerun that finds OUTPUT up to date reads these from the group's
`zarr.json` alone and never imports the Zarr stack (`read_dataset_attrs`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from batchctl.errors import FormatError
from batchctl.store import journal
from batchctl.store.untrusted import parse_json
from batchctl.store.zarrmeta import ZARR_JSON, ArrayMeta, DatasetFiles

FORMAT_VERSION = 3  # 3: the documents hold nothing of the build but its content (`digest`); 2: `source` as UTF-8 bytes
READABLE_VERSIONS = (2, 3)  # a version 2 dataset reads as before; a build builds version 3 anew
RECORD = "batchctl.record"  # in a dataset: which file each of its rows came from (`store.record`)
BUILD_INFO = "batchctl.build.json"  # in a dataset: when, from where and by what it was built (`BuildInfo`)
ATTRS_KEY = "batchctl"
SOURCE = "source"
SOURCE_INDEX = "source_index"
LABEL = "label"
RESERVED_FIELDS = (SOURCE, SOURCE_INDEX, LABEL)
COMPRESSIONS = ("auto", "zstd", "blosc", "none")
ZSTD_LEVEL = 1  # by measurement: 1.65x faster than 3 on decoded photos, ratio 1.117 vs 1.120
DEFAULT_SHARD_BYTES = 128 * 2**20
MIN_SHARD_BATCHES = 2
MAX_SHARD_BATCHES = 256  # tiny rows: a shard index of many thousand chunks costs more than it saves
MAX_SKIPPED_LISTED = 1000  # the attributes list this many skipped files (`errors` counts them all)


@dataclass(frozen=True)
class FieldSpec:
    """Shape and dtype of one sample of a field (the row shape, without the leading N). A
    `ragged` field's rows vary in their first dimension: `shape` is then the rest of a row's
    shape (`()` for tokens, `(4,)` for boxes), and its JSON shape starts with null."""

    shape: tuple[int, ...]
    dtype: str
    ragged: bool = False

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def to_json(self) -> dict[str, Any]:
        return {"shape": [None] * self.ragged + list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, spec: Mapping[str, Any]) -> FieldSpec:
        shape = list(spec["shape"])
        ragged = bool(shape) and shape[0] is None
        return cls(tuple(int(n) for n in shape[ragged:]), str(spec["dtype"]), ragged)

    @classmethod
    def of(cls, value: np.ndarray) -> FieldSpec:
        return cls(tuple(int(n) for n in value.shape), dtype_name(value))

    @classmethod
    def ragged_of(cls, value: np.ndarray) -> FieldSpec:
        """The spec of a ragged field one of whose rows is `value` (its first dimension varies)."""
        return cls(tuple(int(n) for n in value.shape[1:]), dtype_name(value), ragged=True)

    def describe(self) -> str:
        """The row shape as users see it: `(n, 4) float32` for a ragged field."""
        dims = ["n"] * self.ragged + [str(n) for n in self.shape]
        return f"({', '.join(dims)}{',' * (len(dims) == 1)}) {self.dtype}"


def dtype_name(value: np.ndarray) -> str:
    return value.dtype.str if value.dtype.byteorder == ">" else value.dtype.name


# A ragged field F is stored as two arrays (docs/format.md): `F.offsets`, one [start, stop) row per
# sample, and `F.values`, one row per batch holding its samples' values end to end.
OFFSETS_SUFFIX = ".offsets"
VALUES_SUFFIX = ".values"
RAGGED_CHUNKS = 256  # chunks a batch's values may span: the cap on one batch's values, 256 x the chunk
RAGGED_CHUNK_BYTES = (2**16, 2**24)  # a values chunk's bounds; about 1/8 of a batch's values within them


def offsets_array(field_name: str) -> str:
    return field_name + OFFSETS_SUFFIX


def values_array(field_name: str) -> str:
    return field_name + VALUES_SUFFIX


def array_names(schema: Mapping[str, FieldSpec]) -> list[str]:
    """The arrays that store these fields (a ragged field's two)."""
    names: list[str] = []
    for name, spec in schema.items():
        names += [offsets_array(name), values_array(name)] if spec.ragged else [name]
    return names


def ragged_chunk_rows(spec: FieldSpec, first_row: np.ndarray, batch_size: int) -> int:
    """The values per chunk of a ragged field: a power of two near an eighth of a batch's values
    as the first row suggests (so a batch spans a few chunks, and its last chunk's padding is a
    small part of it), within RAGGED_CHUNK_BYTES. Fixed by the first row in dispatch order, so
    a build is reproducible whatever the workers."""
    low, high = RAGGED_CHUNK_BYTES
    unit = max(spec.row_bytes, 1)
    want = max(first_row.nbytes, unit) * batch_size // 8
    chunk_bytes = min(high, max(low, 1 << max(want - 1, 1).bit_length()))
    return max(1, chunk_bytes // unit)


Schema = dict[str, FieldSpec]


@dataclass(frozen=True)
class Layout:
    """How rows map onto chunks and shard files."""

    batch_size: int
    shard_batches: int

    @property
    def shard_rows(self) -> int:
        return self.batch_size * self.shard_batches


def default_shard_batches(batch_size: int, schema: Schema, ragged_row_bytes: int = 0) -> int:
    """About DEFAULT_SHARD_BYTES of uncompressed data per shard, within MIN/MAX_SHARD_BATCHES
    (a ragged field's rows counted as `ragged_row_bytes`, what the first row suggests)."""
    row_bytes = sum(spec.row_bytes for spec in schema.values() if not spec.ragged) + 16 + ragged_row_bytes
    return min(MAX_SHARD_BATCHES, max(MIN_SHARD_BATCHES, DEFAULT_SHARD_BYTES // (batch_size * row_bytes)))


def parse_compression(name: str) -> str:
    if name not in COMPRESSIONS:
        raise FormatError(f"Expected compression one of {', '.join(COMPRESSIONS)}, got {name!r} instead.")
    return name


@dataclass
class DatasetAttrs:
    """The group attributes under "batchctl"; `complete` is set true last of all. Nothing here
    depends on when, where or by how many workers the dataset was built: the build's own facts
    are in `BuildInfo` (`batchctl.build.json`, in the dataset's folder beside the group's `zarr.json`)."""

    batch_size: int
    shard_batches: int
    fields: dict[str, dict[str, Any]]
    classes: list[str] | None
    preprocess: dict[str, Any]
    compression: str
    digest: str = ""  # of the dataset's content (`batchctl.store.digest`): the version a reader names
    complete: bool = False
    num_samples: int = 0
    num_batches: int = 0
    num_shards: int = 0
    errors: int = 0
    ignored: int = 0
    skipped: list[list[str]] = field(default_factory=list)  # [source, reason] of the first MAX_SKIPPED_LISTED
    ignored_paths: list[str] = field(default_factory=list)  # the first 1000 files in SOURCE not taken
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def build_id(self) -> str:
        """The dataset's version, as readers and caches name it: its content digest (a version 2
        dataset's random build id)."""
        return self.digest

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> DatasetAttrs:
        version = raw.get("format_version")
        if version not in READABLE_VERSIONS:
            raise FormatError(f"Expected batchctl format_version {FORMAT_VERSION}, got {version!r} instead.")
        known = {f for f in cls.__dataclass_fields__}
        given = {k: v for k, v in raw.items() if k in known}
        if version == 2:
            given["digest"] = raw.get("build_id", "")
        try:
            attrs = cls(**given)
        except TypeError as exc:
            raise FormatError(f"batchctl attributes are incomplete: {exc}") from exc
        try:
            attrs.check()
        except FormatError as exc:
            raise FormatError(f"batchctl attributes are damaged: {exc}") from None
        return attrs

    def check(self) -> None:
        """Every attribute of the type and range batchctl writes (a reader sizes things by them)."""
        journal.whole(self.batch_size, "batch_size", 1)
        for name in ("shard_batches", "num_samples", "num_batches", "num_shards", "errors", "ignored"):
            journal.whole(getattr(self, name), name)
        for name in ("compression", "digest"):
            if not isinstance(getattr(self, name), str):
                raise FormatError(f"{name} is {getattr(self, name)!r}, not a string")
        if not isinstance(self.complete, bool) or not isinstance(self.preprocess, dict):
            raise FormatError("complete or preprocess is of the wrong type")
        journal.check_classes(self.classes)
        for name, spec in journal.mapping(self.fields, "fields").items():
            shape = journal.mapping(spec, f"field {name!r}").get("shape")
            dims = journal.sequence(shape, f"the shape of {name!r}")
            for n in dims[1:] if dims and dims[0] is None else dims:  # null first: a ragged field
                journal.whole(n, f"a dimension of {name!r}")
            if not isinstance(spec.get("dtype"), str):
                raise FormatError(f"the dtype of {name!r} is {spec.get('dtype')!r}")
        if not all(isinstance(path, str) for path in journal.sequence(self.ignored_paths, "ignored_paths")):
            raise FormatError("an ignored path is not a string")
        for entry in journal.sequence(self.skipped, "skipped"):
            if not isinstance(entry, list) or len(entry) != 2 or not all(isinstance(v, str) for v in entry):
                raise FormatError(f"a skipped entry is {entry!r}, not [source, reason]")
        if self.complete and self.num_batches != num_batches(self.num_samples, self.batch_size):
            raise FormatError(f"num_batches {self.num_batches} does not fit {self.num_samples} samples")
        if self.complete and self.num_shards != num_batches(self.num_batches, max(self.shard_batches, 1)):
            raise FormatError(f"num_shards {self.num_shards} does not fit {self.num_batches} batches")

    @property
    def layout(self) -> Layout:
        return Layout(self.batch_size, self.shard_batches)

    @property
    def schema(self) -> Schema:
        return {name: FieldSpec.from_json(spec) for name, spec in self.fields.items()}


@dataclass(frozen=True)
class BuildInfo:
    """`batchctl.build.json` in a dataset: the facts of the build that made it, kept out of the
    Zarr documents so two builds of the same files on two machines hold the same documents.
    `fingerprint` says what it was built from (paths, sizes, mtimes, options: a rerun finds it
    up to date by it); `record_sha256` vouches for the record beside it. No time is kept
    anywhere in a dataset: a rebuild of the same files on the same machine is the same bytes."""

    digest: str
    batchctl_version: str
    source: str
    fingerprint: str
    record_sha256: str
    shards: dict[str, str] = field(default_factory=dict)  # each shard file's hash (`shardhash.shard_hash`), by key

    def to_bytes(self) -> bytes:
        return (json.dumps(asdict(self), indent=2) + "\n").encode()


def read_build_info(location: str, storage_options: Mapping[str, Any] | None = None) -> BuildInfo | None:
    """The build info in the dataset at `location`, or None when there is none (or it is not
    of batchctl's form: nothing is trusted from it then)."""
    try:
        raw = DatasetFiles(location, storage_options or {}).read(BUILD_INFO)
    except Exception:  # noqa: BLE001 - missing, unreadable
        return None
    return parse_build_info(raw)


def parse_build_info(data: bytes) -> BuildInfo | None:
    """A build info's bytes as one, or None when they are not of its form."""
    try:
        raw = parse_json(data)
        info = BuildInfo(**{name: raw[name] for name in BuildInfo.__dataclass_fields__ if name in raw})
    except Exception:  # noqa: BLE001 - not JSON, not ours
        return None
    texts = [value for name, value in asdict(info).items() if name != "shards"]
    hashes = info.shards if isinstance(info.shards, dict) else None
    if hashes is None or not all(isinstance(v, str) for v in [*texts, *hashes, *hashes.values()]):
        return None
    return info


def num_batches(num_samples: int, batch_size: int) -> int:
    return -(-num_samples // batch_size)


SOURCE_WIDTH_STEP = 32


def source_width(relpaths: Iterable[str]) -> int:
    """The width of the `source` array: the longest path's UTF-8 bytes, rounded up to a multiple
    of SOURCE_WIDTH_STEP, so that a later incremental build can add somewhat longer paths."""
    longest = max((len(path.encode("utf-8")) for path in relpaths), default=1)
    return -(-max(longest, 1) // SOURCE_WIDTH_STEP) * SOURCE_WIDTH_STEP


def read_dataset_attrs(location: str, storage_options: Mapping[str, Any] | None = None) -> DatasetAttrs | None:
    """The batchctl attributes in the group `zarr.json` at `location` (complete or not), or None
    when there is no such file or it does not hold them."""
    try:
        raw = DatasetFiles(location, storage_options or {}).read(ZARR_JSON)
        return DatasetAttrs.from_json(parse_json(raw)["attributes"][ATTRS_KEY])
    except Exception:  # noqa: BLE001 - missing, unreadable, not JSON, not ours: no dataset to trust
        return None


ArrayNotes = Mapping[str, Mapping[str, Any]]  # field -> {"dimension_names": [...], "attributes": {...}}

TEXT_ATTRIBUTES = {"encoding": "UTF-8", "meaning": "text, zero-padded to the row's width"}  # a text field


def is_text(arr: Any) -> bool:
    """A text field's array (a table's text column): rows of UTF-8 bytes, as `source` is stored."""
    return str(arr.dtype) == "uint8" and len(arr.shape) == 2 and arr.attrs.get("encoding") == "UTF-8"


OWN_ATTRIBUTES: dict[str, dict[str, Any]] = {
    SOURCE: {"encoding": "UTF-8", "meaning": "the sample's file, relative to SOURCE, zero-padded to the row's width"},
    SOURCE_INDEX: {"meaning": "the sample's place among the samples of its file, from 0"},
}


def dimension_names(name: str, ndim: int) -> list[str]:
    """Each field's own names for its row dimensions (xarray needs names of one size throughout)."""
    if name == SOURCE:
        return ["source_byte"]
    field_name, part = ragged_part(name)
    if part == VALUES_SUFFIX:  # a ragged row: its varying length, then the rest of its shape
        return [f"{field_name}_value", *(f"{field_name}_dim{i}" for i in range(ndim - 1))]
    return [f"{name}_dim{i}" for i in range(ndim)]


def describe_arrays(
    files: DatasetFiles, arrays: Mapping[str, ArrayMeta], classes: list[str] | None, notes: ArrayNotes
) -> dict[str, ArrayMeta]:
    """Give each array (`arrays`: the documents as they are) what a reader that opens it alone
    needs (tensorstore, zarrs, dask): the class names on `label`, the encoding of `source`, and
    the preprocessor's notes (an image's `height`, `width`, `channel` dimensions and its layout)
    in its own `zarr.json`. Returns the arrays as written."""
    described = {}
    for name, meta in arrays.items():
        field_name, part = ragged_part(name)
        note = notes.get(field_name, {}) if part != OFFSETS_SUFFIX else {}
        named = list(note.get("dimension_names") or ())
        rows = named if len(named) == meta.ndim - 1 else dimension_names(name, meta.ndim - 1)
        attributes = {**meta.attributes, **OWN_ATTRIBUTES.get(name, {}), **dict(note.get("attributes") or {})}
        if name == LABEL and classes is not None:
            attributes["classes"] = list(classes)  # label i is classes[i]
        first = "sample"
        if part == OFFSETS_SUFFIX:
            rows = [f"{field_name}_bound"]
            attributes.update(ragged_field=field_name, meaning=RAGGED_MEANING.format(field=field_name))
        elif part == VALUES_SUFFIX:
            first = "batch"
            attributes.update(ragged_field=field_name)
        described[name] = replace(meta, dimension_names=(first, *rows), attributes=attributes)
        files.write_array(described[name])
    return described


RAGGED_MEANING = (
    "[start, stop) of each sample's values in its batch's row of {field}.values: sample i is "
    "{field}.values[i // batch_size, start:stop]"
)


def schema_of_arrays(arrays: Mapping[str, ArrayMeta]) -> Schema:
    """The preprocessor's fields, as a dataset's arrays hold them (a resumed build's, a seeded one's)."""
    schema: Schema = {}
    for name, arr in arrays.items():
        field_name, part = ragged_part(name)
        if part == VALUES_SUFFIX:
            schema[field_name] = FieldSpec(tuple(arr.shape[2:]), arr.dtype, ragged=True)
        elif not part and name not in RESERVED_FIELDS:
            schema[name] = FieldSpec(tuple(arr.shape[1:]), arr.dtype)
    return schema


def array_rows(array_name: str, samples: int, batch_size: int) -> int:
    """The rows of an array of a dataset of `samples` samples: one per sample, or per batch."""
    return num_batches(samples, batch_size) if stores_batches(array_name) else samples


def stores_batches(array_name: str) -> bool:
    """Whether the array has a row per batch (a ragged field's values), not one per sample."""
    return ragged_part(array_name)[1] == VALUES_SUFFIX


def ragged_part(array_name: str) -> tuple[str, str]:
    """(field, suffix) of a ragged field's array (`tokens.values` -> ("tokens", ".values")), or
    (name, "") for any other array."""
    for suffix in (OFFSETS_SUFFIX, VALUES_SUFFIX):
        if array_name.endswith(suffix) and len(array_name) > len(suffix):
            return array_name[: -len(suffix)], suffix
    return array_name, ""


def write_dataset_attrs(
    files: DatasetFiles, attrs: DatasetAttrs, new: bool = False, arrays: Mapping[str, ArrayMeta] | None = None
) -> None:
    """Set the group's batchctl attributes; `new`: a new, empty group in place of what was there.
    A complete dataset's group also consolidates its arrays' documents (their final ones:
    `arrays`, or read again)."""
    if new:
        files.create_group({ATTRS_KEY: attrs.to_json()})
    elif attrs.complete:
        files.update_group_attributes({ATTRS_KEY: attrs.to_json()}, arrays if arrays is not None else files.arrays())
    else:
        files.update_group_attributes({ATTRS_KEY: attrs.to_json()})
