"""Metadata tables beside the files (the Hugging Face ImageFolder convention): a `metadata.csv`,
`metadata.jsonl` or `metadata.parquet` in SOURCE or any sub-folder names files in its `file_name`
column, relative to its own folder, and its other columns are values of those files' samples.

Read once, in the parent, before any work: each file's values travel with its task, so no worker
reads a table. A column of numbers (or true/false) becomes a numeric field, a column of lists of
numbers a ragged field, a nested object one field per leaf (`objects.bbox`); `--label COLUMN`
makes a column of names (or whole numbers) the class label, and other text is a text field (UTF-8
rows, as `source` is stored). Columns of other values (lists of text, mixed kinds) are left out,
and said so. A row that cannot be used (no file name, a file not there, a file named twice, a
value missing or of another type than its column's) is one skip naming the table and its line.

A Parquet table SOURCE may hold the files themselves (the Hugging Face hub's form): a column of
bytes, or of `{bytes, path}` structs, is each row's file. Its bytes are hashed here and never kept
(a row's hash covers them: an edited picture is a changed row), and written out again, row group
by row group, for the rows a build preprocesses (`write_contents`): the workers read files.
"""

from __future__ import annotations

import bisect
import csv
import hashlib
import io
import json
import os
import posixpath
import threading
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from batchctl.errors import UsageError
from batchctl.records import parse_ragged_dtype, ragged_dtype
from batchctl.store import metadata, storage

T = TypeVar("T")

TABLE_NAMES = ("metadata.csv", "metadata.jsonl", "metadata.parquet")
SOURCE_SUFFIXES = storage.TABLE_SUFFIXES  # a table given as SOURCE itself
FILE_NAME = "file_name"
MAX_TABLE_BYTES = 2**30  # a table is read whole (CSV and JSONL); a larger one is refused in one line
MAX_CELL_BYTES = 2**16  # a text cell's UTF-8 bytes at most: every row of its field takes the longest's room

ROWS_PER_READ = 4096  # rows of a Parquet table converted at a time
PARQUET_BUFFER_BYTES = 2**20
READ_THREADS = min(8, len(os.sched_getaffinity(0)))  # row groups read at once
CONTENT_ROWS_PER_READ = 64  # ... of one whose rows hold their files: a bounded few MiB of bytes

# a column's kind -> the dtype of its field
DTYPES = {"bool": "bool", "int": "int64", "float": "float64"}


@dataclass(frozen=True)
class Content:
    """A row's file held in the table itself: its size and SHA-256 (its bytes are read again when
    the row is built), and the name it had, if any (whose extension the preprocessor takes)."""

    size: int
    sha256: str
    name: str | None


@dataclass
class Tables:
    """What the tables say: each named file's values (`(field, dtype, value)`, in column order)
    and label, the hash of its row (an edited row is a changed file), the columns left out, and
    the rows that cannot be used."""

    values: dict[str, tuple[tuple[str, str, Any], ...]] = field(default_factory=dict)
    texts: dict[str, int] = field(default_factory=dict)  # text field -> its rows' width in UTF-8 bytes
    labels: dict[str, Any] = field(default_factory=dict)  # relpath -> its --label value
    row_hashes: dict[str, str] = field(default_factory=dict)
    left_out: list[str] = field(default_factory=list)  # "the metadata column 'tags' is left out: ..."
    bad_rows: list[tuple[str, str]] = field(default_factory=list)  # ("TABLE:LINE", why)
    classes: list[str] | None = None  # --label's names, in label order
    contents: dict[str, Content] = field(default_factory=dict)  # "TABLE:LINE" -> the file the row holds
    content_column: str | None = None  # the Parquet column holding the rows' files
    _ids: dict[str, int] = field(default_factory=dict)  # a name's label (made from `classes` once)

    def label_of(self, relpath: str) -> int:
        assert self.classes is not None
        value = self.labels[relpath]
        if isinstance(value, int):
            return value
        if len(self._ids) != len(self.classes):
            self._ids = {name: i for i, name in enumerate(self.classes)}
        return self._ids[value]


@dataclass
class _Row:
    table: str  # the table's path relative to SOURCE
    line: int
    relpath: str
    cells: dict[str, Any]

    @property
    def where(self) -> str:
        return f"{self.table}:{self.line}"


def content_line(relpath: str, table: str) -> int | None:
    """The line (row number, from 1) of a row of `table` whose file it holds ("TABLE:LINE"),
    None for an input that is a file (a row may name one instead)."""
    line = relpath.removeprefix(f"{table}:")
    return int(line) if line != relpath and line.isdigit() else None


def is_table(relpath: str) -> bool:
    return relpath.rsplit("/", 1)[-1] in TABLE_NAMES


def files_root(source: str) -> str:
    """Where the inputs' paths start: SOURCE, or a table SOURCE's folder (or prefix, for a URL)."""
    if is_url_table(source):
        return source.rsplit("/", 1)[0]
    return str(Path(source).parent) if is_table_source(source) else source


def is_table_source(source: str) -> bool:
    """SOURCE is a table (a local file named *.csv, *.tsv, *.jsonl, *.parquet), not a folder."""
    return source.lower().endswith(SOURCE_SUFFIXES) and Path(source).is_file()


def is_url_table(source: str) -> bool:
    """SOURCE is a table in an object store or on a web server (`s3://bucket/train.csv`)."""
    return storage.is_url(source) and source.lower().endswith(SOURCE_SUFFIXES)


def read_tables(
    root: Path,
    tables: Iterable[str],
    present: Callable[[str], bool],
    label: str | None,
    path_column: str = FILE_NAME,
    urls: bool = False,
    text_column: str | None = None,
) -> Tables:
    """The tables at these paths (relative to `root`), over the files there (`present`); with
    `urls`, a row may name a URL instead (a table SOURCE: the workers fetch it). With
    `text_column`, each row is a document, that column's text, held as the row's file."""
    rows: list[_Row] = []
    found = Tables()
    for table in sorted(tables):
        folder = table.rsplit("/", 1)[0] + "/" if "/" in table else ""
        for line, cells in _rows(root / table, table, text_column or path_column, found, urls, text_column):
            if isinstance(cells, str):
                found.bad_rows.append((f"{table}:{line}", cells))
                continue
            if text_column is not None:
                document = cells.pop(text_column, None)
                if not isinstance(document, str) or not document:
                    found.bad_rows.append((f"{table}:{line}", f"no text in its {text_column!r} column"))
                    continue
                data = document.encode()
                rows.append(_Row(table, line, f"{table}:{line}", _leaves(cells)))
                found.contents[rows[-1].relpath] = Content(len(data), hashlib.sha256(data).hexdigest(), None)
                found.content_column = text_column
                continue
            name = cells.pop(path_column, None)
            if isinstance(name, Content):
                rows.append(_Row(table, line, f"{table}:{line}", _leaves(cells)))
                found.contents[rows[-1].relpath] = name
                continue
            relpath, why = _relpath(folder, name, urls)
            if why:
                found.bad_rows.append((f"{table}:{line}", why))
                continue
            rows.append(_Row(table, line, relpath, _leaves(cells)))
    rows = _named_once(rows, present, found)
    kinds = _column_kinds(rows, label, found)
    for row in rows:
        _take(row, kinds, label, found)
    if label is not None:
        found.classes = _classes(found.labels.values(), kinds.get(label))
    return found


def _leaves(cells: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A row's nested objects as one cell per leaf: `{"objects": {"bbox": ...}}` is `objects.bbox`."""
    found: dict[str, Any] = {}
    for name, value in cells.items():
        if isinstance(value, dict) and value:
            found.update(_leaves(value, f"{prefix}{name}."))
        else:
            found[f"{prefix}{name}"] = value
    return found


def _relpath(folder: str, name: Any, urls: bool) -> tuple[str, str]:
    """The file a row names, relative to SOURCE (or a URL, where `urls`), or why it names none."""
    if not isinstance(name, str) or not name.strip():
        return "", "no file name"
    if "://" in name:
        if not urls:
            return "", f"names the URL {name}: only a table SOURCE may name URLs"
        if name.split("://", 1)[0].lower() not in storage.URL_SCHEMES:
            return "", f"names {name}, a URL of a scheme batchctl does not fetch ({', '.join(storage.URL_SCHEMES)})"
        return name, ""
    relpath = posixpath.normpath(folder + name)
    if relpath.startswith(("../", "/")) or relpath == "..":
        return "", f"names {name}, outside the table's folder"
    return relpath, ""


def _rows(
    path: Path, table: str, path_column: str, found: Tables, urls: bool, text_column: str | None = None
) -> Iterable[tuple[int, dict[str, Any] | str]]:
    """(line, cells) of a table, or (line, why it cannot be read) for a malformed line (a CSV's
    `text_column` cells kept as they are written, never read as numbers)."""
    try:
        if table.endswith(".parquet"):  # (read a row group at a time: any size)
            yield from _parquet_rows(path, table, path_column, found, urls, text_column)
            return
        if path.stat().st_size > MAX_TABLE_BYTES:
            raise UsageError(f"{table} is larger than {MAX_TABLE_BYTES >> 20} MiB; split it")
        raw = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"{table} cannot be read: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{table} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None
    if table.endswith(".jsonl"):
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                cells = json.loads(line)
            except ValueError:
                yield number, "not a JSON object"
                continue
            yield number, cells if isinstance(cells, dict) else "not a JSON object"
        return
    reader = csv.reader(io.StringIO(text, newline=""), delimiter="\t" if table.endswith(".tsv") else ",")
    header = next(reader, None)
    if not header or path_column not in header:
        raise UsageError(f"{table} has no {path_column} column (its first line names the columns)")
    while True:
        try:
            values = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:  # a cell past MAX_CELL_BYTES, a stray quote
            yield reader.line_num, f"not a CSV line ({exc})"
            continue
        number = reader.line_num
        if not any(value.strip() for value in values):
            continue
        if len(values) != len(header):
            yield number, f"{len(values)} cells, the header names {len(header)}"
            continue
        yield (
            number,
            {name: value if name == text_column else _cell(value) for name, value in zip(header, values, strict=True)},
        )


def _parquet_file(path: Path, table: str) -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UsageError(f"{table}: reading Parquet needs pyarrow: pip install 'batchctl[tables]'") from None
    try:
        # buffered reads: unbuffered, reading batch by batch held every row group read so far
        # (1.8 GiB of RSS for a 1.4 GiB table of pictures, measured; 0.3 GiB so)
        return pq.ParquetFile(path, buffer_size=PARQUET_BUFFER_BYTES, pre_buffer=False)
    except Exception as exc:  # noqa: BLE001 - pyarrow's own errors (ArrowInvalid...) and OSError
        raise UsageError(f"{table} cannot be read as Parquet: {exc}") from None


def _parquet_rows(
    path: Path, table: str, path_column: str, found: Tables, urls: bool, text_column: str | None = None
) -> Iterable[tuple[int, dict[str, Any] | str]]:
    """A Parquet table's rows, a few thousand at a time (never the whole table). In a table
    SOURCE (`urls`), a column of files (`_content_column`) gives each row's `path_column` cell
    as its `Content` (or, a `{bytes, path}` struct without bytes, its path); other columns of
    bytes are left out, and said so."""
    parquet = _parquet_file(path, table)
    schema = parquet.schema_arrow
    content = _content_column(schema, path_column) if urls and text_column is None else None
    if content is None and path_column not in schema.names:
        raise UsageError(f"{table} has no {path_column} column (nor a column of the files' bytes)")
    files = [f.name for f in schema if _holds_files(f.type) and f.name != content]
    for name in files:
        found.left_out.append(f"the metadata column {name!r} is left out: it holds bytes, and {content!r} the files")
    columns = [name for name in schema.names if name not in files]

    def rows_of(parquet: Any, group: int, first: int) -> list[tuple[int, dict[str, Any] | str]]:
        if content is None:
            batches = parquet.iter_batches(ROWS_PER_READ, [group], columns)
            return list(enumerate((row for batch in batches for row in batch.to_pylist()), first))
        rows: list[tuple[int, dict[str, Any] | str]] = []
        for batch in parquet.iter_batches(CONTENT_ROWS_PER_READ, [group], columns):
            others = batch.select([n for n in columns if n != content]).to_pylist()
            for cells, (data, name) in zip(others, _files_of(batch.column(content)), strict=True):
                file = None if data is None else Content(len(data), hashlib.sha256(data).hexdigest(), name)
                cells[path_column] = name if file is None else file
                rows.append((first + len(rows), cells))
        return rows

    for rows in _by_row_group(path, table, parquet, rows_of):
        yield from rows
    if content is not None:
        found.content_column = content


def _by_row_group(
    path: Path, table: str, parquet: Any, read: Callable[[Any, int, int], T], groups: Collection[int] | None = None
) -> Iterator[T]:
    """`read(file, group, its first line)` of each row group (of `groups`), in order, a few row
    groups at once on threads (pyarrow's reads and hashlib release the GIL: a table of pictures
    read and hashed at several times one thread's rate), each thread with its own file."""
    firsts = [1]
    for group in range(parquet.metadata.num_row_groups):
        firsts.append(firsts[-1] + parquet.metadata.row_group(group).num_rows)
    local = threading.local()

    def one(group: int) -> T:
        if not hasattr(local, "parquet"):
            local.parquet = _parquet_file(path, table)
        return read(local.parquet, group, firsts[group])

    pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="batchctl-table")
    try:
        yield from pool.map(one, range(parquet.metadata.num_row_groups) if groups is None else groups)
    finally:
        pool.shutdown(cancel_futures=True)


def _holds_files(kind: Any) -> bool:
    """A column of bytes, or of `{bytes, path}` structs (how Hugging Face stores an Image or Audio)."""
    import pyarrow as pa

    if pa.types.is_struct(kind) and kind.get_field_index("bytes") >= 0:
        kind = kind.field(kind.get_field_index("bytes")).type
    return bool(pa.types.is_binary(kind) or pa.types.is_large_binary(kind))


def _content_column(schema: Any, path_column: str) -> str | None:
    """The column whose cells are the rows' files: `path_column` when it holds bytes; else, when
    the table has no `path_column`, its first column of bytes."""
    if path_column in schema.names:
        return path_column if _holds_files(schema.field(path_column).type) else None
    return next((f.name for f in schema if _holds_files(f.type)), None)


def _files_of(column: Any) -> list[tuple[Any, str | None]]:
    """Each cell of a column of files: its bytes (an Arrow buffer, not copied; None for none) and
    its struct's `path` (None for none, or an empty one)."""
    import pyarrow as pa

    names: list[Any] = [None] * len(column)
    if pa.types.is_struct(column.type):
        fields = dict(zip([f.name for f in column.type], column.flatten(), strict=True))  # (a null struct: nulls)
        column = fields["bytes"]
        if "path" in fields and pa.types.is_string(fields["path"].type):
            names = [name or None for name in fields["path"].to_pylist()]
    return [(cell.as_buffer(), name) for cell, name in zip(column, names, strict=True)]


def write_texts(table: Path, column: str, lines: Collection[int], folder: Path) -> None:
    """The documents of `column` in these rows, written to `folder` as UTF-8 named by line (the
    text preprocessor takes paths)."""
    wanted = set(lines)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    for line, cells in _rows(table, table.name, column, Tables(), True, column):
        if line in wanted and isinstance(cells, dict) and isinstance(text := cells.get(column), str):
            (folder / str(line)).write_bytes(text.encode())


def write_contents(table: Path, column: str, lines: Collection[int], folder: Path) -> None:
    """The files a Parquet table holds for these rows, written to `folder` named by line
    (preprocessors and plugins take paths); only the row groups that hold one are read."""
    parquet = _parquet_file(table, table.name)
    wanted, wanted_set = sorted(lines), set(lines)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)

    def write(parquet: Any, group: int, first: int) -> None:
        line = first
        for batch in parquet.iter_batches(CONTENT_ROWS_PER_READ, [group], [column]):
            for data, _ in _files_of(batch.column(0)):
                if data is not None and line in wanted_set:
                    (folder / str(line)).write_bytes(data)
                line += 1

    groups, first = [], 1
    for group in range(parquet.metadata.num_row_groups):
        rows = parquet.metadata.row_group(group).num_rows
        at = bisect.bisect_left(wanted, first)
        if at < len(wanted) and wanted[at] < first + rows:
            groups.append(group)
        first += rows
    for _ in _by_row_group(table, table.name, parquet, write, groups):
        pass


_NUMBER_STARTS = frozenset("+-.iInN")  # what a number int() or float() reads may start with, but a digit
_KINDS = {bool: "bool", int: "int", float: "float", str: "text"}


def _cell(value: str) -> Any:
    """A CSV cell as the value it spells: a whole number, a number, true/false, else text (an
    empty cell: None)."""
    stripped = value.strip()
    if not stripped:
        return None
    first = stripped[0]
    if first.isdigit() or first in _NUMBER_STARTS:  # (no failed int() and float() for each path and name)
        for kind in (int, float):
            try:
                return kind(stripped)
            except ValueError:
                pass
    elif len(stripped) in (4, 5) and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    return value


def _named_once(rows: list[_Row], present: Callable[[str], bool], found: Tables) -> list[_Row]:
    first: dict[str, _Row] = {}
    kept = []
    for row in rows:
        if row.relpath in first:
            found.bad_rows.append((row.where, f"names {row.relpath} again (first on {first[row.relpath].where})"))
        elif row.relpath not in found.contents and not present(row.relpath):
            found.bad_rows.append((row.where, f"names {row.relpath}, which is not there"))
        else:
            first[row.relpath] = row
            kept.append(row)
    return kept


def _kind(value: Any) -> str:
    kind = _KINDS.get(type(value))
    if kind is not None:
        return kind
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, list):
        return _list_kind(value)
    return "text" if isinstance(value, str) else "object"


def _list_kind(value: list[Any]) -> str:
    """`list` (a ragged field's row: numbers, or equal lists of numbers, `[[x, y, w, h], ...]`),
    `empty`, or `nested list` (of anything else)."""
    if not value:
        return "empty"
    try:
        array = np.asarray(value)
    except ValueError:  # lists of unequal lengths
        return "nested list"
    return "list" if array.dtype.kind in "biuf" else "nested list"


def _column_kinds(rows: list[_Row], label: str | None, found: Tables) -> dict[str, str]:
    """Each column's kind, from all its values (whole numbers among floats are floats); the
    columns that become no field are said once each."""
    seen: dict[str, Counter[str]] = {}
    for row in rows:
        for name, value in row.cells.items():
            if value is not None:
                seen.setdefault(name, Counter())[_kind(value)] += 1
    kinds = {}
    for name, counted in seen.items():
        kind = _column_kind(counted)
        if name == label:
            if kind not in ("text", "int"):
                raise UsageError(f"--label {label}: the column holds {kind} values, not class names or whole numbers")
            kinds[name] = kind
        elif kind in DTYPES or kind in ("list", "text"):
            if name in metadata.RESERVED_FIELDS or metadata.ragged_part(name)[1]:
                raise UsageError(f"the metadata column {name!r} is a name batchctl keeps for itself: rename it")
            kinds[name] = kind
        else:
            found.left_out.append(f"the metadata column {name!r} is left out: batchctl stores no {kind} values yet")
    if label is not None and label not in kinds:
        raise UsageError(f"--label {label}: no metadata table has that column")
    for name, kind in kinds.items():
        if kind == "list":
            kinds[name] = _ragged_dtype([row.cells.get(name) for row in rows])
        elif kind == "text" and name != label:
            texts = [v for row in rows if isinstance(v := row.cells.get(name), str)]
            texts = [v for v in texts if len(v.encode()) <= MAX_CELL_BYTES]  # (a longer one is its row's skip)
            found.texts[name] = metadata.source_width(texts)  # (rounded up: an edit rarely needs more)
            kinds[name] = f"text:{found.texts[name]}"
    return kinds


def _ragged_dtype(values: list[Any]) -> str:
    """A list column's field: `ragged:DTYPE:TRAILING` (its rows' dtype, and the dimensions after
    the first, the same in every row: a row whose are not is skipped)."""
    arrays = [np.asarray(v) for v in values if isinstance(v, list) and v and _list_kind(v) == "list"]
    dtype = "float64" if any(a.dtype.kind == "f" for a in arrays) else "int64"
    if arrays and all(a.dtype.kind == "b" for a in arrays):
        dtype = "bool"
    return ragged_dtype(dtype, arrays[0].shape[1:] if arrays else ())


def _column_kind(counted: Counter[str]) -> str:
    """The kind of most of a column's values (whole numbers among fractions count as fractions,
    empty lists among lists as lists); a row of another kind is that row's skip. "mixed" when no
    kind holds more than half."""
    counted = Counter(counted)
    if "float" in counted:
        counted["float"] += counted.pop("int", 0)
    if "list" in counted or set(counted) == {"empty"}:
        counted["list"] += counted.pop("empty", 0)
    kind, count = counted.most_common(1)[0]
    return kind if count * 2 > sum(counted.values()) else "mixed"


def _take(row: _Row, kinds: Mapping[str, str], label: str | None, found: Tables) -> None:
    values = []
    labelled = None
    for name, kind in kinds.items():
        value = row.cells.get(name)
        if value is None:
            found.bad_rows.append((row.where, f"no value for the column {name!r}"))
            return
        if kind.startswith("ragged:"):
            problem = _ragged_problem(name, kind, value)
            if problem:
                found.bad_rows.append((row.where, problem))
                return
            values.append((name, kind, value))
            continue
        if kind.startswith("text:"):
            if not isinstance(value, str):
                found.bad_rows.append((row.where, f"the column {name!r} holds text, this row {value!r}"))
                return
            if len(value.encode()) > MAX_CELL_BYTES:
                found.bad_rows.append((row.where, f"the text in {name!r} is longer than {MAX_CELL_BYTES} bytes"))
                return
            values.append((name, kind, value))
            continue
        got = _kind(value)
        if kind == "float" and got == "int":
            value, got = float(value), "float"
        if got != kind:
            found.bad_rows.append((row.where, f"the column {name!r} holds {kind} values, this row {value!r}"))
            return
        if name == label:
            if kind == "int" and value < 0:
                found.bad_rows.append((row.where, f"the label {value} is negative"))
                return
            labelled = value
        else:
            values.append((name, DTYPES[kind], value))
    found.values[row.relpath] = tuple(values)
    if labelled is not None:
        found.labels[row.relpath] = labelled
    content = found.contents.get(row.relpath)
    hashed = [values, labelled] if content is None else [values, labelled, content.sha256]
    found.row_hashes[row.relpath] = hashlib.sha256(json.dumps(hashed).encode()).hexdigest()


def _ragged_problem(name: str, kind: str, value: Any) -> str:
    """Why a list column's cell is not one of its rows ("" when it is)."""
    trailing = parse_ragged_dtype(kind)[1]
    if not isinstance(value, list) or _kind(value) not in ("list", "empty"):
        return f"the column {name!r} holds lists of numbers, this row {str(value)[:60]!r}"
    found = np.asarray(value).shape[1:] if value else trailing
    if found != trailing:
        return f"the column {name!r} holds rows of {trailing or 'numbers'}, this row {found}"
    return ""


def _classes(labels: Iterable[Any], kind: str | None) -> list[str]:
    """Class names in label order: a column of names sorted; whole numbers name themselves (0 to
    the largest, so that a label keeps its value)."""
    values = set(labels)
    if kind == "int":
        return [str(n) for n in range(max(values, default=-1) + 1)]
    return sorted(str(v) for v in values)
