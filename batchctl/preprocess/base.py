"""What a preprocessor is: a function from one file to samples, its options and the files it
takes. The built-ins (image, audio, npy) and a user's plugins are all `Preprocessor`s."""

from __future__ import annotations

import fnmatch
import inspect
import json
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from batchctl.errors import UsageError

Sample = dict[str, np.ndarray]


class Block(dict[str, Any]):
    """Many samples at once: field name -> array whose rows (axis 0) are the samples. A
    preprocessor may return one instead of yielding samples, to skip the per-sample overhead."""


PreprocessFn = Callable[..., Any]
_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "text"}


@dataclass(frozen=True)
class Preprocessor:
    """A named preprocessing function, the files it takes and its default options."""

    name: str
    fn: PreprocessFn
    extensions: tuple[str, ...] | None = None
    defaults: Mapping[str, Any] = field(default_factory=dict)
    # For preprocessors that yield many samples per file: `count(path, **options)` says how many
    # (cheaply, from the header), and `fn` then takes `part=(start, stop)` to yield just those,
    # so a big file is split into parts that several workers take.
    count: Callable[..., int | None] | None = None
    include: tuple[str, ...] = ()  # globs (--include, or a plugin's own `takes`): replace the extension filter
    check: Callable[[Mapping[str, Any]], None] | None = None  # raises UsageError for bad options
    # What its output depends on besides its options: a built-in's version, raised whenever its
    # output for the same file and options would change; for a plugin, the SHA-256 of the file
    # holding the function. Part of what "up to date" compares.
    code: str = ""
    # what each field's row dimensions are and say, from the options: written into the arrays'
    # own metadata for readers that open one alone ({field: {"dimension_names", "attributes"}})
    describe: Callable[[Mapping[str, Any]], Mapping[str, Mapping[str, Any]]] | None = None
    # fields whose rows vary in their first dimension (tokens, boxes, encoded bytes): `@ragged`;
    # or, where that depends on the options (the image built-in's `store`), `ragged_for(options)`
    ragged: tuple[str, ...] = ()
    ragged_for: Callable[[Mapping[str, Any]], tuple[str, ...]] | None = None
    # the options that matter under the given ones (`relevant(merged, given)`): the others are not
    # recorded, so they neither rebuild a dataset nor pass unnoticed (it may refuse them)
    relevant: Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any]] | None = None
    # other files a plugin reads for each input (`@reads`): their stamps join the input's own
    reads: tuple[str, ...] = ()

    def ragged_fields(self, options: Mapping[str, Any]) -> tuple[str, ...]:
        return self.ragged_for(options) if self.ragged_for is not None else self.ragged

    def accepts(self, relpath: str) -> bool:
        if self.include:
            name = relpath.rsplit("/", 1)[-1]
            return any(fnmatch.fnmatchcase(relpath, g) or fnmatch.fnmatchcase(name, g) for g in self.include)
        if self.extensions is None:
            return True
        return relpath.lower().endswith(self.extensions)

    def options(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """Defaults overlaid with the given options, refusing names the preprocessor lacks and
        (for a plugin) checking them against its signature: before any work, not once per file."""
        accepted, required = self._parameters()
        unknown = sorted(set(given) - accepted) if accepted is not None else []
        if unknown:
            takes = f"takes options {', '.join(sorted(accepted or ()))}" if accepted else "takes no options"
            raise UsageError(f"Preprocessor {self.name!r} {takes}; got {', '.join(unknown)} instead.")
        missing = sorted(required - set(given))
        if missing:
            raise UsageError(f"Preprocessor {self.name!r} needs --option {'=..., --option '.join(missing)}=...")
        merged = {**self.defaults, **self._typed(given)}
        if self.check is not None:
            self.check(merged)
        return merged if self.relevant is None else self.relevant(merged, given)

    def _typed(self, given: Mapping[str, Any]) -> dict[str, Any]:
        """The given options as the types the function declares (its annotations, else its
        defaults' types): an int where an int is wanted, never a str for every file to trip on."""
        expected = self._option_types()
        typed = {}
        for name, value in given.items():
            want = expected.get(name)
            if want is None or (type(value) is want):
                typed[name] = value
            elif want is float and type(value) is int:
                typed[name] = float(value)
            elif want is str and isinstance(value, (bool, int, float)):
                typed[name] = json.dumps(value)  # `--option name=12` read as JSON; the function takes text
            else:
                raise UsageError(
                    f"Preprocessor {self.name!r} option {name}: expected {_TYPE_NAMES[want]}, got {value!r}."
                )
        return typed

    def _option_types(self) -> dict[str, type]:
        """bool, int, float or str for each option whose type is declared or shown by its default."""
        if self.defaults:
            return {k: type(v) for k, v in self.defaults.items() if type(v) in _TYPE_NAMES}
        try:
            params = list(inspect.signature(self.fn).parameters.values())[1:]
            hints = typing.get_type_hints(self.fn)
        except Exception:  # noqa: BLE001 - unresolvable annotations, no signature: nothing to check against
            return {}
        found = {}
        for param in params:
            hint = hints.get(param.name)
            if hint in _TYPE_NAMES:
                found[param.name] = hint
            elif param.default is not param.empty and type(param.default) in _TYPE_NAMES:
                found[param.name] = type(param.default)
        return found

    def _parameters(self) -> tuple[set[str] | None, set[str]]:
        """The option names the function takes (None: any, it has **kwargs) and those it needs."""
        if self.defaults:
            return set(self.defaults), set()
        try:
            params = list(inspect.signature(self.fn).parameters.values())[1:]  # after the path
        except (TypeError, ValueError):  # no signature to read (some builtins): let it be
            return None, set()
        if any(p.kind is p.VAR_KEYWORD for p in params):
            return None, set()
        named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "part"]
        return {p.name for p in named}, {p.name for p in named if p.default is p.empty}

    def columns(
        self, path: Path | Any, options: Mapping[str, Any], part: tuple[int, int] | None = None
    ) -> dict[str, np.ndarray]:
        """Run the function on a file's path (or a Python input); its samples stacked field by
        field (row i of each column is sample i)."""
        result = self.fn(path, **options) if part is None else self.fn(path, **options, part=part)
        ragged = self.ragged_fields(options)
        if ragged:
            return self._ragged_columns(result, ragged)
        if type(result) is dict and result:  # one sample, most files: ~1 us less than the general path
            return {str(k): native(np.asarray(v))[np.newaxis] for k, v in result.items()}
        if isinstance(result, Block):
            columns = {str(k): native(np.asarray(v)) for k, v in result.items()}
            if not columns or len({len(v) for v in columns.values()}) != 1:
                raise ValueError("a Block needs fields with the same number of rows")
            return columns
        samples = list(self._normalise(result))
        if not samples:
            raise ValueError("the preprocessor produced no samples")
        return stack_samples(samples)

    def _ragged_columns(self, result: Any, ragged: tuple[str, ...]) -> dict[str, np.ndarray]:
        """Columns where the ragged fields' are object arrays of rows (the general path: a Block's
        ragged field is a sequence of rows)."""
        if isinstance(result, Block):
            fields = {str(k): v if str(k) in ragged else np.asarray(v) for k, v in result.items()}
            if not fields or len({len(v) for v in fields.values()}) != 1:
                raise ValueError("a Block needs fields with the same number of rows")
            rows = len(next(iter(fields.values())))
            samples = [{name: native(np.asarray(value[i])) for name, value in fields.items()} for i in range(rows)]
        else:
            samples = list(self._normalise(result))
        if not samples:
            raise ValueError("the preprocessor produced no samples")
        return stack_samples(samples, ragged)

    def _normalise(self, result: Any) -> Iterator[Sample]:
        stream = [result] if isinstance(result, Mapping) else result
        for raw in stream:
            if not isinstance(raw, Mapping) or not raw:
                raise TypeError(f"preprocessor {self.name} returned {type(raw).__name__}, expected a dict of arrays")
            yield {str(k): native(np.asarray(v)) for k, v in raw.items()}


def native(array: np.ndarray) -> np.ndarray:
    """The array in this machine's byte order: a big-endian field from some decoder is the same
    field as a little-endian one, and is stored little-endian (docs/format.md)."""
    if array.dtype.isnative:
        return array
    return array.astype(array.dtype.newbyteorder("="))


def stack_samples(samples: list[Sample], ragged: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Samples -> one column per field; a file whose samples disagree in shape is refused. A
    `ragged` field's column is an object array of its rows, which agree in all but their first
    dimension."""
    if ragged:
        return _ragged_stack(samples, ragged)
    if len(samples) == 1:  # most files: a view with a leading axis, no copy (np.stack costs ~5 us)
        return {name: value[np.newaxis] for name, value in samples[0].items()}
    first = {name: (value.shape, value.dtype) for name, value in samples[0].items()}
    for number, sample in enumerate(samples[1:], start=1):
        if sample.keys() != first.keys() or any((v.shape, v.dtype) != first[k] for k, v in sample.items()):
            raise ValueError(f"sample {number} of this file does not match its first sample's fields and shapes")
    return {name: np.stack([sample[name] for sample in samples]) for name in first}


def _ragged_stack(samples: list[Sample], ragged: tuple[str, ...]) -> dict[str, np.ndarray]:
    missing = sorted(set(ragged) - samples[0].keys())
    if missing:
        raise ValueError(f"the ragged field {missing[0]!r} is not among the sample's fields")
    fixed = [{k: v for k, v in sample.items() if k not in ragged} for sample in samples]
    columns = stack_samples(fixed) if fixed[0] else {}
    for name in ragged:
        rows = [sample[name] for sample in samples]
        first = rows[0]
        if first.ndim == 0:
            raise ValueError(f"the ragged field {name!r} is a scalar, not an array of rows")
        for number, row in enumerate(rows):
            if row.ndim != first.ndim or row.shape[1:] != first.shape[1:] or row.dtype != first.dtype:
                got, want = f"{row.shape} {row.dtype}", f"{first.shape} {first.dtype}"
                raise ValueError(f"sample {number} of this file has {name} {got}, its first {want}")
        column = np.empty(len(rows), dtype=object)
        for i, row in enumerate(rows):
            column[i] = row
        columns[name] = column
    return {name: columns[name] for name in samples[0]}


def ragged_rows(column: np.ndarray) -> bool:
    """Whether a column holds a ragged field's rows (an object array of arrays)."""
    return column.dtype == object


FILES_ATTRIBUTE = "batchctl_files"
RAGGED_ATTRIBUTE = "batchctl_ragged"


def ragged(*fields: str) -> Callable[[PreprocessFn], PreprocessFn]:
    """Declare fields whose rows vary in their first dimension (`@ragged("tokens", "boxes")`: a
    document's tokens `(n,)`, an image's boxes `(n, 4)`); their other dimensions and dtype are
    fixed. Stored as values and offsets (docs/format.md), read as a list of arrays or padded."""
    if not fields or not all(isinstance(f, str) and f for f in fields):
        raise UsageError(f"@ragged needs field names, got {fields!r}")

    def declare(fn: PreprocessFn) -> PreprocessFn:
        setattr(fn, RAGGED_ATTRIBUTE, tuple(fields))
        return fn

    return declare


def takes(*globs: str) -> Callable[[PreprocessFn], PreprocessFn]:
    """Declare the files a plugin preprocesses, as globs matched against the file name or the
    relative path (`@takes("*.wav", "*.flac")`); other files are ignored. `--include` overrides it."""

    def declare(fn: PreprocessFn) -> PreprocessFn:
        setattr(fn, FILES_ATTRIBUTE, tuple(globs))
        return fn

    return declare


READS_ATTRIBUTE = "batchctl_reads"
_PLACEHOLDERS = ("{stem}", "{name}")


def reads(*patterns: str) -> Callable[[PreprocessFn], PreprocessFn]:
    """Declare the other files a plugin reads, so that editing one rebuilds what it touches:
    a sidecar beside each input (`"{stem}.json"`: photo.jpg's photo.json; `"{name}.txt"`:
    photo.jpg.txt; relative to the input's folder) or a file every input shares (`"labels.csv"`,
    relative to SOURCE). Their sizes and mtimes join each input's fingerprint; the sidecars
    themselves are not inputs. Checked at import, in one line."""
    checked = tuple(_reads_pattern(pattern) for pattern in patterns)
    if not checked:
        raise UsageError("@reads needs at least one file name or pattern, such as '{stem}.json'")

    def declare(fn: PreprocessFn) -> PreprocessFn:
        setattr(fn, READS_ATTRIBUTE, checked)
        return fn

    return declare


def _reads_pattern(pattern: Any) -> str:
    if not isinstance(pattern, str) or not pattern.strip():
        raise UsageError(f"@reads takes file names or patterns such as '{{stem}}.json', got {pattern!r}")
    if pattern.startswith("/") or ".." in pattern.split("/"):
        raise UsageError(f"@reads: {pattern!r} must stay inside SOURCE (a relative path without '..')")
    bare = pattern
    for placeholder in _PLACEHOLDERS:
        bare = bare.replace(placeholder, "")
    if "{" in bare or "}" in bare:
        raise UsageError(
            f"@reads: {pattern!r} may hold only {{stem}} and {{name}} (the input's name without and with its extension)"
        )
    return pattern


def read_path(pattern: str, relpath: str) -> str:
    """The file `pattern` names for the input at `relpath`, relative to SOURCE: beside the input
    when the pattern holds a placeholder, else SOURCE's own file."""
    if not any(placeholder in pattern for placeholder in _PLACEHOLDERS):
        return pattern
    folder, _, name = relpath.rpartition("/")
    stem = name.rsplit(".", 1)[0] if "." in name.lstrip(".") else name
    named = pattern.replace("{stem}", stem).replace("{name}", name)
    return f"{folder}/{named}" if folder else named


DESCRIBE_ATTRIBUTE = "batchctl_fields"
FieldNotes = Mapping[str, Mapping[str, Any]]  # field -> {"dimension_names": [...], "attributes": {...}}


def describes(**fields: Mapping[str, Any]) -> Callable[[PreprocessFn], PreprocessFn]:
    """Say what a plugin's fields are, for readers that open one array alone (tensorstore, zarrs,
    xarray): each field's row dimension names and attributes, written into its own `zarr.json`
    (`@describes(tokens={"dimension_names": ["token"], "attributes": {"meaning": "byte values"}})`).
    Checked before any work: names a list of strings, attributes a JSON object."""
    notes = check_field_notes(fields, "@describes")

    def declare(fn: PreprocessFn) -> PreprocessFn:
        setattr(fn, DESCRIBE_ATTRIBUTE, notes)
        return fn

    return declare


def check_field_notes(fields: Mapping[str, Any], where: str) -> dict[str, dict[str, Any]]:
    """Field notes as plain JSON (`describes`), or a UsageError naming what is wrong."""
    checked: dict[str, dict[str, Any]] = {}
    for name, note in fields.items():
        if not isinstance(note, Mapping) or set(note) - {"dimension_names", "attributes"}:
            raise UsageError(f"{where}: {name} must be a mapping of 'dimension_names' and 'attributes', got {note!r}")
        names = note.get("dimension_names", [])
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and n for n in names):
            raise UsageError(f"{where}: {name}'s dimension_names must be a list of names, got {names!r}")
        attributes = note.get("attributes", {})
        try:
            plain = json.loads(json.dumps(dict(attributes), allow_nan=False))
        except (TypeError, ValueError):
            raise UsageError(f"{where}: {name}'s attributes must be a JSON object, got {attributes!r}") from None
        checked[name] = {"dimension_names": list(names), "attributes": plain}
    return checked
