"""Incremental builds with the real CLI: rounds of added, removed and changed files; each result
holds exactly the rows a fresh build holds, and only the new work is done."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest

import batchctl
from batchctl.read.inspect import verify
from batchctl.store.digest import shard_file_hash
from batchctl.store.shardhash import OLD_SHARD_HASH
from batchctl.store.zarrmeta import DatasetFiles
from batchctl.synthetic import make_image_folder, photo

from .conftest import PLUGINS, kill_group, run_cli, start_cli, sweep, sweep_rng, wait_for, wait_group_gone
from .stress import expected_codes, run_trial

LAYOUT = ["--batch-size", "4", "--shard-batches", "2", "--workers", "2"]
SMALL = ["--resize", "32", "--crop", "32", *LAYOUT]


def rows_by_key(location: str | Path, **kwargs: object) -> dict[tuple[str, int], np.ndarray]:
    """Every row of a dataset keyed by (source, source_index); fails on a key seen twice."""
    rows: dict[tuple[str, int], np.ndarray] = {}
    for batch in batchctl.open(location, **kwargs):  # type: ignore[arg-type]
        for source, index, image, label in zip(
            batch["source"], batch["source_index"], batch["image"], batch["label"], strict=True
        ):
            key = (str(source), int(index))
            assert key not in rows, f"{key} appears twice"
            rows[key] = np.concatenate([image.ravel(), [label]])
    return rows


def assert_same_rows(got: dict[tuple[str, int], np.ndarray], want: dict[tuple[str, int], np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for key, row in want.items():
        np.testing.assert_array_equal(got[key], row, err_msg=str(key))


def change_files(folder: Path, round_: int) -> dict[str, list[str]]:
    """Add 3 images, remove 2 and rewrite 2 (new content, new size), spread over the classes."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    added = make_image_folder(folder / "new", 3, sides=(60, 90), seed=100 + round_)
    moved = []
    for path in added:  # into the class folders, under names of this round
        target = folder / path.parent.name / f"r{round_}-{path.name}"
        path.rename(target)
        moved.append(target)
    shutil.rmtree(folder / "new")
    removed, rewritten = files[round_::11][:2], files[round_ + 5 :: 13][:2]
    for path in removed:
        path.unlink()
    for i, path in enumerate(rewritten):
        photo(70 + i, 80, seed=999 + round_).save(path.with_suffix(".png"), format="PNG")
        os.replace(path.with_suffix(".png"), path)  # same name, other bytes
    rel = lambda paths: sorted(p.relative_to(folder).as_posix() for p in paths)  # noqa: E731
    return {"added": rel(moved), "removed": rel(removed), "changed": rel(rewritten)}


def new_image(scratch: Path, target: Path, seed: int) -> None:
    """A new photo at `target` (made in `scratch`, then moved in whole)."""
    made = make_image_folder(scratch / f"new{seed}", 1, classes=(), sides=(60, 70), seed=seed)[0]
    made.rename(target)
    made.parent.rmdir()


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    make_image_folder(root, 40, sides=(60, 120))
    return root


def build(folder: Path, output: Path | str, *extra: str) -> dict:
    path = folder.parent / f"{Path(str(output)).name}.report.json"
    result = run_cli("build", folder, "-o", output, *SMALL, *extra, "--report", path)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    data = json.loads(path.read_text())
    data["stderr"] = result.stderr
    return data


def test_three_rounds_of_changes_match_a_fresh_build(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "data.zarr"
    first = build(folder, out)
    assert first["added"] is None and first["processed"] == 40
    for round_ in range(3):
        changed = change_files(folder, round_)
        report = build(folder, out)
        assert {key: report[key]["paths"] for key in ("added", "changed", "removed")} == changed
        line = f"{len(changed['added'])} added, {len(changed['changed'])} changed, {len(changed['removed'])} removed"
        assert f"{line} since the last build" in report["stderr"]
        assert report["processed"] == len(changed["added"]) + len(changed["changed"])  # nothing else preprocessed
        fresh = tmp_path / f"fresh{round_}.zarr"
        build(folder, fresh)
        assert_same_rows(rows_by_key(out), rows_by_key(fresh))
        assert verify(out) == []
        assert run_cli("build", folder, "-o", out, *SMALL).stderr.count("up to date") == 1


def test_only_an_added_file_rewrites_only_the_last_shard(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "data.zarr"
    build(folder, out)  # 40 rows: 5 full shards of 8
    before = {p.name: p.stat().st_ino for p in (out / "source_index" / "c").iterdir()}
    new_image(tmp_path, folder / "cat" / "late.jpg", 7)
    report = build(folder, out)
    assert report["processed"] == 1 and report["kept_samples"] == 40 and report["samples"] == 41
    after = {p.name: p.stat().st_ino for p in (out / "source_index" / "c").iterdir()}
    assert sorted(after) == ["0", "1", "2", "3", "4", "5"]
    assert all(after[name] == before[name] for name in before)  # the full shards kept as they were (linked)


@pytest.mark.parametrize("earlier", ["whole-file SHA-256", "digest 2"])
def test_a_dataset_of_an_earlier_batchctl_shard_hashes_is_updated_without_redoing_its_shards(
    folder: Path, tmp_path: Path, earlier: str
) -> None:
    """Shard hashes are now trees of BLAKE3 chunk hashes (digest 3). A build info holding an
    earlier batchctl's hashes is not taken for damage: whole-file SHA-256s (before digest 2) are
    not trusted, the kept shards checked by their index; digest 2's SHA-256 trees still check
    the kept shards' bytes. Either way the hashes are read again and the digest is this version's."""
    out = tmp_path / "data.zarr"
    build(folder, out)
    info = json.loads((out / "batchctl.build.json").read_text())
    assert all(found.startswith("blake3-chunks:") for found in info["shards"].values())
    if earlier == "digest 2":
        info["shards"] = digest_2_hashes(out, info["shards"])
    else:
        info["shards"] = {key: hashlib.sha256((out / key).read_bytes()).hexdigest() for key in info["shards"]}
    (out / "batchctl.build.json").write_text(json.dumps(info))  # as an earlier batchctl wrote it
    new_image(tmp_path, folder / "cat" / "late.jpg", 7)
    report = build(folder, out)
    assert report["processed"] == 1 and report["kept_samples"] == 40 and "damaged" not in report["stderr"]
    assert verify(out) == []  # the digest recomputed from the files is the one published
    rebuilt = json.loads((out / "batchctl.build.json").read_text())["shards"]
    assert all(found.startswith("blake3-chunks:") for found in rebuilt.values())


def digest_2_hashes(out: Path, keys: Iterable[str]) -> dict[str, str]:
    """The shard files `keys` of the dataset at `out` hashed as batchctl did before digest 3."""
    files, per_shard = DatasetFiles(str(out)), batchctl.open(out).attrs.shard_batches
    hashes = {key: shard_file_hash(files, key, per_shard, OLD_SHARD_HASH) for key in keys}
    assert all(found.startswith("sha256-chunks:") for found in hashes.values())
    return hashes


def test_a_kept_shard_changed_under_a_digest_2_hash_is_damage(folder: Path, tmp_path: Path) -> None:
    """A digest 2 hash in the build info still vouches for the bytes of a shard kept whole: a
    byte changed in it is found before the shard is linked into the new version."""
    out = tmp_path / "data.zarr"
    build(folder, out)
    info = json.loads((out / "batchctl.build.json").read_text())
    info["shards"] = digest_2_hashes(out, info["shards"])
    (out / "batchctl.build.json").write_text(json.dumps(info))
    shard = out / "image" / "c" / "1" / "0" / "0" / "0"
    data = shard.read_bytes()
    shard.unlink()  # (a hard link of the work folder's past: edited in place, as damage would be)
    shard.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    new_image(tmp_path, folder / "cat" / "late.jpg", 7)
    report = build(folder, out)
    assert "shard 1 of the last build is damaged (image:" in report["stderr"], report["stderr"]
    assert report["redone"]["count"] == 8 and report["processed"] == 9  # its 8 files, and the new one
    assert verify(out) == []


def test_an_interrupted_incremental_run_resumes(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "data.zarr"
    slow = ["--preprocess", f"{PLUGINS}:slow_image", "--option", "delay=0.15", *LAYOUT]
    report = tmp_path / "r.json"
    assert run_cli("build", folder, "-o", out, *slow).returncode == 0
    for i in range(12):
        new_image(tmp_path, folder / "dog" / f"new{i}.jpg", 50 + i)
    removed = sorted(folder.rglob("*.jpg"))[0]
    removed.unlink()
    proc = start_cli("build", folder, "-o", out, *slow)
    work = tmp_path / ".data.zarr.batchctl" / "journal.jsonl"
    wait_for(lambda: work.exists() and work.stat().st_size > 0 and _new_rows_journaled(work) >= 2)
    kill_group(proc, signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr
    assert wait_group_gone(proc.pid) == []
    assert batchctl.open(out).num_samples == 40  # the previous version, untouched

    result = run_cli("build", folder, "-o", out, *slow, "--report", report)
    assert result.returncode == 0, result.stderr
    data = json.loads(report.read_text())
    assert data["resumed_samples"] >= 2 and data["processed"] <= 12 - 2
    assert data["added"]["count"] == 12 and data["removed"]["paths"] == [removed.relative_to(folder).as_posix()]
    fresh = tmp_path / "fresh.zarr"
    assert run_cli("build", folder, "-o", fresh, *slow).returncode == 0
    assert_same_rows(rows_by_key(out), rows_by_key(fresh))


def _new_rows_journaled(journal: Path) -> int:
    """Rows of files named new* in the journal."""
    count = 0
    for text in journal.read_text().splitlines():
        try:
            line = json.loads(text)
        except ValueError:
            break
        count += sum(entry[1] for entry in line.get("files", []) if entry[0].split("/")[-1].startswith("new"))
    return count


def test_checksum_sees_new_content_behind_an_old_mtime(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "data.zarr"
    build(folder, out, "--checksum")
    victim = sorted(folder.rglob("*.jpg"))[3]
    stat = victim.stat()
    data = bytearray(victim.read_bytes())
    other = sorted(folder.rglob("*.jpg"))[4].read_bytes()
    victim.write_bytes(other[: len(data)].ljust(len(data), b"\0"))  # same size, other content
    os.utime(victim, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the old mtime
    report = build(folder, out, "--checksum")
    assert report["changed"]["paths"] == [victim.relative_to(folder).as_posix()] and report["processed"] == 1
    fresh = tmp_path / "fresh.zarr"
    build(folder, fresh)
    assert_same_rows(rows_by_key(out), rows_by_key(fresh))


def test_checksum_keeps_the_rows_of_touched_files_of_the_same_content(folder: Path, tmp_path: Path) -> None:
    """With --checksum a file whose mtime changed and content did not is unchanged: its rows are
    kept (they used to be thrown away with a "changed or vanished" note and a whole rebuild)."""
    out = tmp_path / "data.zarr"
    build(folder, out, "--checksum")
    for path in folder.rglob("*.jpg"):
        os.utime(path, ns=(time.time_ns(), time.time_ns()))
    shutil.copy(next(folder.rglob("*.jpg")), folder / "cat" / "extra.jpg")
    report = build(folder, out, "--checksum")
    assert report["added"]["paths"] == ["cat/extra.jpg"] and report["changed"]["count"] == 0
    assert report["processed"] == 1 and "starting over" not in report["stderr"], report["stderr"]
    fresh = tmp_path / "fresh.zarr"
    build(folder, fresh)
    assert_same_rows(rows_by_key(out), rows_by_key(fresh))


def test_other_options_rebuild_everything_and_say_why(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "data.zarr"
    build(folder, out)
    (folder / "cat" / "extra.jpg").write_bytes((next(folder.rglob("*.jpg"))).read_bytes())
    result = run_cli("build", folder, "-o", out, *SMALL[:-4], "--shard-batches", "3", "--workers", "2")
    assert result.returncode == 0 and "building everything: shard_batches was 2, now 3" in result.stderr
    forced = run_cli("build", folder, "-o", out, *SMALL, "--shard-batches", "3", "--force")
    assert forced.returncode == 0 and "building everything (--force)" in forced.stderr


def test_a_skipped_file_is_not_tried_again_until_it_changes(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "data.zarr"
    bad = folder / "fish" / "broken.jpg"
    bad.write_bytes(b"not an image")
    first = build(folder, out)
    assert [e["source"] for e in first["errors"]] == ["fish/broken.jpg"]
    new_image(tmp_path, folder / "cat" / "n.jpg", 3)
    second = build(folder, out)
    assert second["processed"] == 1 and second["added"]["paths"] == ["cat/n.jpg"]
    assert [e["source"] for e in second["errors"]] == ["fish/broken.jpg"]  # still counted, not retried
    assert "skipped fish/broken.jpg" not in second["stderr"]
    bad.write_bytes(b"still not an image, but changed")
    third = build(folder, out)
    assert third["changed"]["paths"] == ["fish/broken.jpg"] and third["processed"] == 1


def test_signals_at_random_moments_of_incremental_runs(folder: Path, tmp_path: Path) -> None:
    """Incremental runs (three; eight in make test-long), each stopped by SIGINT or SIGTERM (to
    the parent or the group) at a random moment from its first second to past its publish: each
    exits as a user expects with nothing left behind, OUTPUT stays a complete dataset, and the
    next run ends with exactly a fresh build's rows."""
    out = tmp_path / "data.zarr"
    plugin = ["--preprocess", f"{PLUGINS}:slow_image", *LAYOUT]
    slow = [*plugin, "--option", "delay=0.2"]

    def more_changes(round_: int) -> None:
        change_files(folder, round_)
        for i in range(6):
            new_image(tmp_path, folder / "fish" / f"more{round_}-{i}.jpg", 1000 * round_ + i)

    assert run_cli("build", folder, "-o", out, *slow).returncode == 0
    more_changes(0)
    started = time.monotonic()
    assert run_cli("build", folder, "-o", out, *slow).returncode == 0
    run_s = time.monotonic() - started
    rng = sweep_rng("signals in incremental runs")
    failures = []
    for n in range(sweep(3, 8)):
        more_changes(n + 1)
        sig = (signal.SIGINT, signal.SIGTERM)[n % 2]
        delay = rng.uniform(0, 1) if n % 3 == 0 else rng.uniform(1, run_s * 1.1)
        trial = run_trial(["build", str(folder), *slow, "-q"], out, sig, ("parent", "group")[(n // 2) % 2], delay)
        if trial.code not in expected_codes(sig) or trial.traceback or trial.orphans or trial.leaked:
            failures.append(trial.line() + "\n" + trial.stderr[-500:])
        assert batchctl.open(out).num_samples > 0  # the old version or the new one, complete
        assert run_cli("build", folder, "-o", out, *slow).returncode == 0
        fresh = tmp_path / f"fresh{n}.zarr"
        assert run_cli("build", folder, "-o", fresh, *plugin, "--option", "delay=0").returncode == 0
        assert_same_rows(rows_by_key(out), rows_by_key(fresh))
        shutil.rmtree(fresh)
    assert failures == []


def test_new_rows_are_appended_to_a_copy_of_the_short_last_shard(folder: Path, tmp_path: Path) -> None:
    """Only added files: the short last shard is copied (its rows never decoded) and filled up; the
    published one is never written to."""
    new_image(tmp_path, folder / "dog" / "first-extra.jpg", 11)
    out = tmp_path / "data.zarr"
    build(folder, out)  # 41 rows: 5 full shards and a last one of 1 row
    before = rows_by_key(out)
    tail = out / "source_index" / "c" / "5"
    tail_bytes, tail_inode = tail.read_bytes(), tail.stat().st_ino
    os.link(tail, tmp_path / "old-tail")  # the published file itself, whatever happens to its name
    for i in range(4):
        new_image(tmp_path, folder / "cat" / f"late{i}.jpg", 20 + i)
    report = build(folder, out)
    assert report["processed"] == 4 and report["kept_samples"] == 41 and report["samples"] == 45
    assert tail.stat().st_ino != tail_inode and (tmp_path / "old-tail").read_bytes() == tail_bytes
    fresh = tmp_path / "fresh.zarr"
    build(folder, fresh)
    after = rows_by_key(out)
    assert_same_rows(after, rows_by_key(fresh))
    assert all(np.array_equal(after[key], row) for key, row in before.items())


@pytest.mark.parametrize("damage", ["truncated", "a flipped byte", "a FIFO", "deleted"])
def test_a_damaged_kept_shard_is_rebuilt_from_its_files_never_vouched_for(
    folder: Path, tmp_path: Path, damage: str
) -> None:
    out = tmp_path / "data.zarr"
    build(folder, out)  # 40 rows: 5 full shards of 8
    shard = out / "image" / "c" / "1" / "0" / "0" / "0"
    data = shard.read_bytes()
    shard.unlink()  # (a hard link of the work folder's past: edited in place, as damage would be)
    if damage == "truncated":
        shard.write_bytes(data[: len(data) // 2])
    elif damage == "a flipped byte":
        shard.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])
    elif damage == "a FIFO":
        os.mkfifo(shard)
    new_image(tmp_path, folder / "cat" / "late.jpg", 7)
    report = build(folder, out)
    assert "shard 1 of the last build is damaged (image:" in report["stderr"], report["stderr"]
    assert report["redone"]["count"] == 8 and report["processed"] == 9  # its 8 files, and the new one
    assert verify(out) == []
    fresh = tmp_path / "fresh.zarr"
    build(folder, fresh)
    assert_same_rows(rows_by_key(out), rows_by_key(fresh))


def test_an_incremental_runs_progress_and_summary_count_the_rows_it_carries(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "data.zarr"
    build(folder, out)  # 40 rows: 5 full shards of 8
    (sorted((folder / "cat").iterdir())[0]).unlink()  # a removal rewrites its shard: its 7 other rows are carried
    report = build(folder, out)
    assert report["processed"] == 0 and report["carried_samples"] == 7 and report["kept_samples"] == 39
    assert "39 samples kept, 7 of them carried into rewritten shards" in report["stderr"]
    assert "samples/s written" in report["stderr"] and report["samples_per_s"] > 0  # carrying is this run's work

    import io

    from batchctl import progress as progress_module

    monkeypatch.setattr(progress_module, "LOG_INTERVAL_S", 0.0)
    shown = io.StringIO()
    progress = progress_module.ConsoleProgress(stream=shown)
    progress.start(tasks=3, batches_done=30, carried=97)
    progress.files_done(3)
    progress.batches_written(1, rows=40)
    line = shown.getvalue().splitlines()[-1]
    assert "3/3 files" in line and "40/100 rows written" in line and "ETA" in line, line


def test_an_interrupted_run_over_a_damaged_kept_shard_resumes_with_the_same_plan(folder: Path, tmp_path: Path) -> None:
    """The files of a damaged shard are preprocessed again by the run that found it, and by its
    resume: state.json names the damaged shards, so the resumed plan does not vouch for them."""
    out = tmp_path / "data.zarr"
    slow = ["--preprocess", f"{PLUGINS}:slow_image", "--option", "delay=0.15", *LAYOUT]
    assert run_cli("build", folder, "-o", out, *slow).returncode == 0  # 40 rows: 5 full shards of 8
    shard = out / "image" / "c" / "1" / "0" / "0" / "0"
    data = shard.read_bytes()
    shard.unlink()
    shard.write_bytes(data[: len(data) // 2])
    new_image(tmp_path, folder / "dog" / "late.jpg", 77)
    proc = start_cli("build", folder, "-o", out, *slow)
    state = tmp_path / ".data.zarr.batchctl" / "state.json"
    wait_for(lambda: state.exists() and "damaged_shards" in state.read_text())
    time.sleep(0.3)  # some of the shard's files preprocessed again, not all (0.15 s each, 2 workers)
    kill_group(proc, signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr
    report = tmp_path / "r.json"
    result = run_cli("build", folder, "-o", out, *slow, "--report", report)
    assert result.returncode == 0, result.stderr
    assert verify(out) == []
    fresh = tmp_path / "fresh.zarr"
    assert run_cli("build", folder, "-o", fresh, *slow).returncode == 0
    assert_same_rows(rows_by_key(out), rows_by_key(fresh))  # every file once: none of the damaged shard's lost
