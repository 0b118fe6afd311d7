"""Metadata tables beside the files: `metadata.csv` / `metadata.jsonl` name files by `file_name`;
`--label COLUMN` gives the classes, numeric columns become fields. The real CLI on real files."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import batchctl
from tests.conftest import run_cli

NPY = ["--preprocess", "npy", "--batch-size", "4", "--workers", "2"]


def arrays(folder: Path, count: int) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        np.save(folder / f"a{i}.npy", np.full(3, i, np.float32))
    return [f"a{i}.npy" for i in range(count)]


def rows_of(out: Path) -> dict[str, dict[str, object]]:
    ds = batchctl.open(out)
    found: dict[str, dict[str, object]] = {}
    for batch in ds:
        for i, source in enumerate(batch["source"]):
            found[str(source)] = {k: batch[k][i].tolist() for k in batch if k not in ("source", "source_index")}
    return found


@pytest.fixture
def kaggle(tmp_path: Path) -> Path:
    """A flat folder of arrays and a metadata.csv: a class name, a score, a flag and a caption."""
    src = tmp_path / "src"
    names = arrays(src / "imgs", 10)
    lines = ["file_name,species,score,flag,caption"]
    for i, name in enumerate(names):
        lines.append(f"imgs/{name},{['cat', 'dog'][i % 2]},{i * 0.5},{str(i % 3 == 0).lower()},a caption {i}")
    lines += ["imgs/gone.npy,cat,1,true,x", "imgs/a1.npy,cat,1,true,again", ",cat,1,true,no name", "imgs/a2.npy,cat"]
    (src / "metadata.csv").write_text("\n".join(lines) + "\n")
    np.save(src / "imgs" / "unnamed.npy", np.zeros(3, np.float32))
    return src


def test_a_metadata_csv_gives_labels_and_fields_and_names_each_bad_line(kaggle: Path, tmp_path: Path) -> None:
    out, report = tmp_path / "o.zarr", tmp_path / "r.json"
    result = run_cli("build", kaggle, "-o", out, *NPY, "--label", "species", "--report", report)
    assert result.returncode == 0, result.stderr
    ds = batchctl.open(out)
    assert ds.classes == ["cat", "dog"] and ds.num_samples == 10
    rows = rows_of(out)
    for i in range(10):
        row = rows[f"imgs/a{i}.npy"]
        assert row == {
            "array": [float(i)] * 3, "score": i * 0.5, "flag": i % 3 == 0, "label": i % 2, "caption": f"a caption {i}"
        }
    assert ds.fields["score"][1] == np.dtype("float64") and ds.fields["flag"][1] == np.dtype("bool")
    skipped = {error["source"]: error["error"] for error in json.loads(report.read_text())["errors"]}
    assert skipped == {
        "metadata.csv:12": "names imgs/gone.npy, which is not there",
        "metadata.csv:13": "names imgs/a1.npy again (first on metadata.csv:3)",
        "metadata.csv:14": "no file name",
        "metadata.csv:15": "2 cells, the header names 5",
    }
    assert ds.fields["caption"] == ((), np.dtype("<U"))  # text: UTF-8 rows, read as str
    loaded = next(iter(ds.loader(batch_size=4, seed=1)))
    assert [rows[s]["caption"] for s in loaded["source"]] == list(loaded["caption"])
    assert json.loads(report.read_text())["ignored"]["paths"] == ["imgs/unnamed.npy"]  # no row names it
    assert run_cli("verify", out).returncode == 0


def test_an_edited_label_reprocesses_that_file_only(kaggle: Path, tmp_path: Path) -> None:
    out, report = tmp_path / "o.zarr", tmp_path / "r.json"
    args = ["build", kaggle, "-o", out, *NPY, "--label", "species", "--report", report]
    assert run_cli(*args).returncode == 0
    assert "up to date" in run_cli(*args).stderr
    table = kaggle / "metadata.csv"
    table.write_text(table.read_text().replace("imgs/a3.npy,dog,1.5", "imgs/a3.npy,cat,7.5"))
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr
    data = json.loads(report.read_text())
    assert data["processed"] == 1 and data["changed"]["paths"] == ["imgs/a3.npy"]
    assert rows_of(out)["imgs/a3.npy"] == {
        "array": [3.0] * 3, "score": 7.5, "flag": True, "label": 0, "caption": "a caption 3"
    }
    fresh = tmp_path / "fresh.zarr"
    assert run_cli("build", kaggle, "-o", fresh, *NPY, "--label", "species").returncode == 0
    assert rows_of(out) == rows_of(fresh)


def test_a_jsonl_table_in_a_sub_folder_names_files_beside_it_and_whole_numbers_label_themselves(
    tmp_path: Path,
) -> None:
    src = tmp_path / "src"
    names = arrays(src / "part1", 6)
    lines = [json.dumps({"file_name": n, "y": [0, 2, 5][i % 3], "w": i}) for i, n in enumerate(names)]
    (src / "part1" / "metadata.jsonl").write_text("\n".join([*lines, "{not json"]) + "\n")
    out, report = tmp_path / "o.zarr", tmp_path / "r.json"
    result = run_cli("build", src, "-o", out, *NPY, "--label", "y", "--report", report)
    assert result.returncode == 0, result.stderr
    ds = batchctl.open(out)
    assert ds.classes == ["0", "1", "2", "3", "4", "5"]  # a label keeps its value
    rows = rows_of(out)
    assert {name: (row["label"], row["w"]) for name, row in rows.items()} == {
        f"part1/a{i}.npy": ([0, 2, 5][i % 3], i) for i in range(6)
    }
    assert [e["source"] for e in json.loads(report.read_text())["errors"]] == ["part1/metadata.jsonl:7"]


@pytest.mark.parametrize(
    ("table", "said"),
    [
        ("file_name,kind\na0.npy,1.5\n", "--label kind: the column holds float values, not class names or whole"),
        ("file_name,other\na0.npy,x\n", "--label kind: no metadata table has that column"),
        ("name,kind\na0.npy,cat\n", "metadata.csv has no file_name column"),
        ("file_name,kind,label\na0.npy,cat,3\n", "the metadata column 'label' is a name batchctl keeps for itself"),
    ],
)
def test_a_table_that_cannot_label_is_one_usage_error(tmp_path: Path, table: str, said: str) -> None:
    src = tmp_path / "src"
    arrays(src, 2)
    (src / "metadata.csv").write_text(table)
    result = run_cli("build", src, "-o", tmp_path / "o.zarr", *NPY, "--label", "kind")
    assert result.returncode == 2 and said in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_label_without_a_table_is_a_usage_error(tmp_path: Path) -> None:
    src = tmp_path / "src"
    arrays(src, 2)
    result = run_cli("build", src, "-o", tmp_path / "o.zarr", *NPY, "--label", "kind")
    assert result.returncode == 2 and "holds no metadata.csv or metadata.jsonl or metadata.parquet" in result.stderr


def test_a_non_utf8_table_is_one_line(tmp_path: Path) -> None:
    src = tmp_path / "src"
    arrays(src, 2)
    (src / "metadata.csv").write_bytes("file_name,kind\na0.npy,caf\xe9\n".encode("latin-1"))
    result = run_cli("build", src, "-o", tmp_path / "o.zarr", *NPY, "--label", "kind")
    assert result.returncode == 2 and "metadata.csv is not UTF-8 text" in result.stderr, result.stderr


def test_a_parquet_table_read_by_row_groups(tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    src = tmp_path / "src"
    names = arrays(src, 9)
    kinds, weights = [["a", "b", "c"][i % 3] for i in range(9)], [i * 1.5 for i in range(9)]
    table = pa.table({"file_name": names, "kind": kinds, "w": weights})
    pq.write_table(table, src / "metadata.parquet", row_group_size=4)  # three row groups
    out = tmp_path / "o.zarr"
    result = run_cli("build", src, "-o", out, *NPY, "--label", "kind")
    assert result.returncode == 0, result.stderr
    assert batchctl.open(out).classes == ["a", "b", "c"]
    assert {name: (row["label"], row["w"]) for name, row in rows_of(out).items()} == {
        f"a{i}.npy": (i % 3, i * 1.5) for i in range(9)
    }


def test_a_table_as_source_names_its_files_and_rebuilds_an_edited_row_alone(tmp_path: Path) -> None:
    """`batchctl build train.tsv`: its rows name files relative to its folder (`--path-column`),
    the dataset goes beside it as train.zarr; a path outside its folder is a skip."""
    folder = tmp_path / "data"
    names = arrays(folder / "x", 7)
    lines = ["path\tkind\tweight", *(f"x/{n}\t{'ab'[i % 2]}\t{i}" for i, n in enumerate(names))]
    lines += ["../outside.npy\ta\t1"]
    table = folder / "train.tsv"
    table.write_text("\n".join(lines) + "\n")
    report = tmp_path / "r.json"
    args = ["build", table, *NPY, "--label", "kind", "--path-column", "path", "--report", report]
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr
    out = folder / "train.zarr"
    assert batchctl.open(out).classes == ["a", "b"]
    assert {name: (row["label"], row["weight"]) for name, row in rows_of(out).items()} == {
        f"x/a{i}.npy": (i % 2, i) for i in range(7)
    }
    skipped = {error["source"]: error["error"] for error in json.loads(report.read_text())["errors"]}
    assert skipped == {"train.tsv:9": "names ../outside.npy, outside the table's folder"}
    assert "up to date" in run_cli(*args).stderr
    table.write_text(table.read_text().replace("x/a4.npy\ta\t4", "x/a4.npy\tb\t40"))
    assert run_cli(*args).returncode == 0
    data = json.loads(report.read_text())
    assert data["processed"] == 1 and data["changed"]["paths"] == ["x/a4.npy"]
    assert rows_of(out)["x/a4.npy"] == {"array": [4.0] * 3, "weight": 40, "label": 1}


def test_lists_become_ragged_fields_and_objects_one_field_per_leaf(tmp_path: Path) -> None:
    """COCO-style boxes beside each file: `objects: {bbox: [[x, y, w, h], ...], category: [...]}`
    are the fields `objects.bbox` (n, 4) and `objects.category` (n,); a row whose boxes are not
    4 wide is a skip."""
    src = tmp_path / "src"
    names = arrays(src, 6)
    lines = []
    for i, name in enumerate(names):
        boxes = [[j, j + 0.5, 2, 3] for j in range(i % 3)]
        lines.append(json.dumps({"file_name": name, "objects": {"bbox": boxes, "category": list(range(i % 3))}}))
    lines.append(json.dumps({"file_name": "a0.npy"}))
    (src / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    (src / "more").mkdir()
    np.save(src / "more" / "b.npy", np.zeros(3, np.float32))
    bad = {"file_name": "b.npy", "objects": {"bbox": [[1, 2, 3]], "category": [0]}}
    (src / "more" / "metadata.jsonl").write_text(json.dumps(bad) + "\n")
    out, report = tmp_path / "o.zarr", tmp_path / "r.json"
    result = run_cli("build", src, "-o", out, *NPY, "--report", report)
    assert result.returncode == 0, result.stderr
    ds = batchctl.open(out)
    assert ds.fields["objects.bbox"] == ((-1, 4), np.dtype("float64"))
    assert ds.fields["objects.category"] == ((-1,), np.dtype("int64"))
    rows = rows_of(out)
    for i in range(6):
        assert rows[f"a{i}.npy"]["objects.bbox"] == [[j, j + 0.5, 2, 3] for j in range(i % 3)]
        assert rows[f"a{i}.npy"]["objects.category"] == list(range(i % 3))
    errors = {e["source"]: e["error"] for e in json.loads(report.read_text())["errors"]}
    assert errors == {
        "metadata.jsonl:7": "names a0.npy again (first on metadata.jsonl:1)",
        "more/metadata.jsonl:1": "the column 'objects.bbox' holds rows of (4,), this row (3,)",
    }
    assert run_cli("verify", out).returncode == 0


def test_text_is_stored_as_utf8_rows_other_readers_open_and_a_longer_one_rebuilds(
    kaggle: Path, tmp_path: Path
) -> None:
    """A caption column: a (rows, width) uint8 array of zero-padded UTF-8 (as `source`), marked
    `encoding: UTF-8` for zarr-python and tensorstore; a caption longer than the width (32-byte
    steps) is another layout, so the rebuild builds everything, saying why."""
    import zarr

    out = tmp_path / "o.zarr"
    args = ["build", kaggle, "-o", out, *NPY, "--label", "species"]
    assert run_cli(*args).returncode == 0
    array = zarr.open_array(str(out / "caption"), mode="r")
    assert (array.dtype, array.shape[1], array.attrs["encoding"]) == (np.dtype("uint8"), 32, "UTF-8")
    texts = {bytes(row).rstrip(b"\0").decode() for row in array[:]}
    assert texts == {f"a caption {i}" for i in range(10)}
    table = kaggle / "metadata.csv"
    table.write_text(table.read_text().replace("a caption 5", "ünïcode " * 8))
    result = run_cli(*args)
    assert result.returncode == 0
    assert "building everything: text was {'caption': 32}, now {'caption': 96}" in result.stderr
    assert rows_of(out)["imgs/a5.npy"]["caption"] == "ünïcode " * 8


@pytest.fixture
def web(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A real HTTP server on loopback serving a folder, in a thread."""
    import functools
    import http.server
    import threading

    served = tmp_path / "www"
    served.mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(served)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", served
    finally:
        server.shutdown()
        server.server_close()


def test_a_table_of_urls_is_fetched_by_the_workers_and_a_failed_fetch_is_one_skip(
    web: tuple[str, Path], tmp_path: Path
) -> None:
    """img2dataset's shape: `url,caption` rows. The workers fetch each URL (retrying what
    passes), `source` is the URL, a 404 or a refused connection is a skip naming the URL."""
    base, served = web
    names = arrays(served, 5)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # a port nobody listens on
    port = closed.getsockname()[1]
    closed.close()
    lines = ["url,caption", *(f"{base}/{n},text {i}" for i, n in enumerate(names))]
    lines += [f"{base}/gone.npy,x", f"http://127.0.0.1:{port}/a.npy,y", "ftp://example.com/a.npy,z"]
    table = tmp_path / "urls.csv"
    table.write_text("\n".join(lines) + "\n")
    out, report = tmp_path / "urls.zarr", tmp_path / "r.json"
    args = ["build", table, *NPY, "--path-column", "url", "--report", report]
    result = run_cli(*args, timeout=120)
    assert result.returncode == 0, result.stderr
    rows = rows_of(out)
    captions = {name: row["caption"] for name, row in rows.items()}
    assert captions == {f"{base}/{n}": f"text {i}" for i, n in enumerate(names)}
    assert all(rows[f"{base}/a{i}.npy"]["array"] == [float(i)] * 3 for i in range(5))
    errors = {e["source"]: e["error"] for e in json.loads(report.read_text())["errors"]}
    assert errors[f"{base}/gone.npy"] == f"cannot fetch {base}/gone.npy: HTTP 404 File not found"
    assert errors[f"http://127.0.0.1:{port}/a.npy"].startswith(f"cannot fetch http://127.0.0.1:{port}/a.npy: ")
    assert errors["urls.csv:9"].startswith("names ftp://example.com/a.npy, a URL of a scheme batchctl does not fetch")
    (served / "gone.npy").write_bytes((served / "a0.npy").read_bytes())  # back: the next run fetches it
    again = run_cli(*args, timeout=120)
    assert again.returncode == 0, again.stderr
    data = json.loads(report.read_text())
    assert data["processed"] == 2 and f"{base}/gone.npy" in rows_of(out)  # the two failed fetches, tried again


@pytest.mark.parametrize("form", ["csv", "parquet"], ids=["a CSV of paths", "a Parquet of the pictures"])
def test_a_table_build_killed_at_random_moments_ends_with_the_same_bytes(tmp_path: Path, form: str) -> None:
    """A table SOURCE with labels, numbers and text (or a Parquet holding the pictures), stopped
    by SIGINT, SIGTERM or SIGKILL of its whole group one to three times at random moments, then
    finished: byte for byte the uninterrupted build."""
    from batchctl.synthetic import make_image_folder
    from tests.conftest import sweep, sweep_rng
    from tests.test_reproducible import SLOW, _interrupted_runs, build, tree

    folder = tmp_path / "photos"
    make_image_folder(folder, 60, sides=(40, 90))
    if form == "parquet":
        pytest.importorskip("pyarrow")
        table = tmp_path / "train.parquet"
        _photo_table(folder, table, hf=True)
    else:
        lines = ["file_name,kind,score,caption"]
        for i, path in enumerate(sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.*"))):
            lines.append(f"{path},{path.split('/')[0]},{i / 7},photo number {i}")
        table = folder / "train.csv"
        table.write_text("\n".join(lines) + "\n")
    whole = tmp_path / "whole.zarr"
    build(table, whole, *SLOW, "--workers", "2", "--label", "kind")
    rng = sweep_rng(f"table builds interrupted ({form})")
    for trial in range(sweep(2, 6)):
        out = tmp_path / f"t{trial}.zarr"
        happened = _interrupted_runs(table, out, rng, "--label", "kind")
        assert tree(out) == tree(whole), f"trial {trial}: {happened}"


def test_a_wrong_type_a_huge_cell_and_a_broken_line_are_each_one_skip(tmp_path: Path) -> None:
    src = tmp_path / "src"
    names = arrays(src, 8)
    lines = ["file_name,score,note", *(f"{n},{i},ok {i}" for i, n in enumerate(names[:5]))]
    lines += [f"{names[5]},high,ok", f"{names[6]},6,{'x' * 70_000}", f'{names[7]},7,"broken' + "y" * 140_000]
    (src / "metadata.csv").write_text("\n".join(lines) + "\n")
    out, report = tmp_path / "o.zarr", tmp_path / "r.json"
    result = run_cli("build", src, "-o", out, *NPY, "--report", report)
    assert result.returncode == 0, result.stderr
    assert sorted(rows_of(out)) == names[:5] and batchctl.open(out).fields["note"] == ((), np.dtype("<U"))
    errors = {e["source"]: e["error"] for e in json.loads(report.read_text())["errors"]}
    assert errors["metadata.csv:7"] == "the column 'score' holds int values, this row 'high'"
    assert errors["metadata.csv:8"] == "the text in 'note' is longer than 65536 bytes"
    assert errors["metadata.csv:9"].startswith("not a CSV line (field larger than field limit")
    assert "Traceback" not in result.stderr


def _photo_table(folder: Path, table: Path, hf: bool, changed: int | None = None) -> list[str]:
    """The photos of `folder` as a Parquet table of their bytes, 16 rows a row group: Hugging
    Face's `image: {bytes, path}` structs (`hf`) or a plain `image` column of bytes; with a
    `kind`, a `caption`, and a second column of bytes (a mask) the build leaves out. Row
    `changed` (0-based) holds another photo's bytes. The photos' paths, in row order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.*"))
    data = [(folder / p).read_bytes() for p in paths]
    if changed is not None:
        data[changed] = data[changed + 1]
    images = [{"bytes": d, "path": p.rsplit("/", 1)[-1]} for d, p in zip(data, paths, strict=True)] if hf else data
    columns = {
        "image": images,
        "kind": [p.split("/")[0] for p in paths],
        "caption": [f"photo {i}" for i in range(len(paths))],
        "mask": [b"\x01" * 4] * len(paths),
    }
    pq.write_table(pa.table(columns), table, row_group_size=16)
    return paths


@pytest.mark.parametrize("hf", [True, False], ids=["bytes-and-path structs", "a bytes column"])
def test_a_parquet_of_image_bytes_builds_the_images_a_folder_build_gives(tmp_path: Path, hf: bool) -> None:
    """The Hugging Face hub's form: each row holds its picture. Every row's image, label and
    caption is the folder build's; `source` is TABLE:LINE; corrupt bytes are one skip naming
    the row; the other column of bytes is left out, and said so."""
    pytest.importorskip("pyarrow")
    from batchctl.synthetic import make_image_folder

    folder = tmp_path / "photos"
    make_image_folder(folder, 40, sides=(40, 90))
    folder_out = tmp_path / "folder.zarr"
    assert run_cli("build", folder, "-o", folder_out, "--batch-size", "8", "--workers", "2").returncode == 0
    by_path = {}
    for batch in batchctl.open(folder_out):
        for i, source in enumerate(batch["source"]):
            by_path[str(source)] = (batch["image"][i], int(batch["label"][i]))
    table = tmp_path / "hub" / "train.parquet"
    table.parent.mkdir()
    paths = _photo_table(folder, table, hf)
    (folder / paths[3]).write_bytes(b"not a picture")
    paths_again = _photo_table(folder, table, hf)  # (row 4 now holds broken bytes)
    assert paths_again == paths
    report = tmp_path / "r.json"
    result = run_cli("build", table, "--label", "kind", "--batch-size", "8", "--workers", "2", "--report", report)
    assert result.returncode == 0, result.stderr
    assert "the metadata column 'mask' is left out: it holds bytes, and 'image' the files" in result.stderr
    ds = batchctl.open(table.with_suffix(".zarr"))
    assert ds.classes == ["cat", "dog", "fish"]
    seen = set()
    for batch in ds:
        for i, source in enumerate(batch["source"]):
            line = int(str(source).removeprefix("train.parquet:"))
            image, label = by_path[paths[line - 1]]
            np.testing.assert_array_equal(batch["image"][i], image)
            assert int(batch["label"][i]) == label and batch["caption"][i] == f"photo {line - 1}"
            seen.add(line)
    assert seen == set(range(1, 41)) - {4}
    errors = [(e["source"], e["error"]) for e in json.loads(report.read_text())["errors"]]
    assert errors == [("train.parquet:4", "UnidentifiedImageError: cannot identify image file")]
    assert run_cli("verify", table.with_suffix(".zarr")).returncode == 0
    assert not (table.parent / ".train.zarr.batchctl").exists()  # the rows' files went with the work folder


def test_an_edited_picture_in_a_parquet_rebuilds_that_row_alone(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    from batchctl.synthetic import make_image_folder

    folder = tmp_path / "photos"
    make_image_folder(folder, 24, sides=(40, 90))
    table = tmp_path / "train.parquet"
    paths = _photo_table(folder, table, hf=True)
    report = tmp_path / "r.json"
    args = ["build", table, "--label", "kind", "--batch-size", "8", "--workers", "2", "--report", report]
    assert run_cli(*args).returncode == 0
    assert "up to date" in run_cli(*args).stderr
    _photo_table(folder, table, hf=True, changed=6)
    assert run_cli(*args).returncode == 0
    data = json.loads(report.read_text())
    assert data["processed"] == 1 and data["changed"]["paths"] == ["train.parquet:7"]
    rows = {}
    for batch in batchctl.open(tmp_path / "train.zarr"):
        rows.update({str(s): batch["image"][i] for i, s in enumerate(batch["source"])})
    np.testing.assert_array_equal(rows["train.parquet:7"], rows["train.parquet:8"])
    assert len(rows) == len(paths)


def test_a_struct_without_bytes_names_its_file_and_a_table_without_files_is_one_usage_error(tmp_path: Path) -> None:
    """`{bytes: None, path}` (how Hugging Face keeps a picture it did not embed) names a file
    beside the table; a file the preprocessor does not take is ignored; a Parquet SOURCE with
    neither file names nor bytes is refused in one line."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    src = tmp_path / "src"
    names = arrays(src, 3)
    embedded = [(src / name).read_bytes() for name in names]
    cells = [
        {"bytes": embedded[0], "path": "first.npy"},
        {"bytes": None, "path": names[1]},
        {"bytes": embedded[2], "path": "notes.txt"},
        {"bytes": embedded[2], "path": None},
    ]
    pq.write_table(pa.table({"array_file": cells, "w": [1, 2, 3, 4]}), src / "t.parquet")
    result = run_cli("build", src / "t.parquet", *NPY)
    assert result.returncode == 0, result.stderr
    rows = rows_of(src / "t.zarr")
    assert {name: row["w"] for name, row in rows.items()} == {"t.parquet:1": 1, names[1]: 2, "t.parquet:4": 4}
    assert rows["t.parquet:1"]["array"] == [0.0] * 3 and rows["t.parquet:4"]["array"] == [2.0] * 3
    pq.write_table(pa.table({"w": [1, 2]}), src / "bare.parquet")
    refused = run_cli("build", src / "bare.parquet", *NPY)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "bare.parquet has no file_name column (nor a column of the files' bytes)" in refused.stderr
