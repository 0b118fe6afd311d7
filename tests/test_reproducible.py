"""Reproducible builds: the same files and options give the same bytes under OUTPUT, whatever the
number of workers, the engine, or the interruptions on the way; the content digest says so."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest

import batchctl
from batchctl.run.reorder import Reorder
from batchctl.store.digest import content_digest, shard_file_hash
from batchctl.store.shardhash import OLD_SHARD_HASH
from batchctl.store.zarrmeta import DatasetFiles
from batchctl.synthetic import make_image_folder

from .conftest import PLUGINS, kill_group, run_cli, start_cli, sweep, sweep_rng, wait_for, wait_group_gone
from .test_incremental import change_files

SMALL = ["--resize", "32", "--crop", "32", "--batch-size", "8", "--shard-batches", "2"]
SLOW = ["--preprocess", f"{PLUGINS}:slow_image", "--option", "delay=0.03", "--batch-size", "8", "--shard-batches", "2"]


def tree(output: Path) -> dict[str, bytes]:
    """Every file under OUTPUT, by its path inside it."""
    return {path.relative_to(output).as_posix(): path.read_bytes() for path in output.rglob("*") if path.is_file()}


def assert_same_tree(got: Path, want: Path) -> None:
    mine, theirs = tree(got), tree(want)
    assert sorted(mine) == sorted(theirs)
    differ = [name for name in theirs if mine[name] != theirs[name]]
    assert differ == [], f"{got} differs from {want} in {differ}"


def build(source: Path, output: Path, *extra: str) -> None:
    result = run_cli("build", source, "-o", output, *extra, "--quiet", timeout=300)
    assert result.returncode == 0, result.stderr


def digest_of(output: Path) -> str:
    result = run_cli("info", output, "--json")
    assert result.returncode == 0, result.stderr
    return str(json.loads(result.stdout)["digest"])


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repro") / "photos"
    make_image_folder(root, 90, sides=(40, 90))
    return root


@pytest.fixture(scope="module")
def with_bad_file(photos: Path) -> Path:
    """The photos and one file that does not decode: it is skipped, and the rows close up."""
    folder = photos.parent / "with-bad"
    shutil.copytree(photos, folder, copy_function=shutil.copy2)
    (folder / "dog" / "broken.jpg").write_bytes(b"\xff\xd8 not a jpeg")
    return folder


def test_any_number_of_workers_builds_the_same_bytes(with_bad_file: Path, tmp_path: Path) -> None:
    outputs = []
    for workers in (1, 2, 4):
        out = tmp_path / f"w{workers}.zarr"
        build(with_bad_file, out, *SMALL, "--workers", str(workers))
        outputs.append(out)
    for out in outputs[1:]:
        assert_same_tree(out, outputs[0])
    digest = digest_of(outputs[0])
    assert json.loads((outputs[0] / "batchctl.build.json").read_text())["digest"] == digest
    assert run_cli("verify", outputs[0]).returncode == 0


def test_dask_builds_match_whatever_their_workers_and_the_local_build(photos: Path, tmp_path: Path) -> None:
    pytest.importorskip("distributed")
    outputs = []
    for workers in (2, 3):
        out = tmp_path / f"dask{workers}.zarr"
        build(photos, out, *SMALL, "--engine", "dask", "--workers", str(workers))
        outputs.append(out)
    assert_same_tree(outputs[1], outputs[0])
    local = tmp_path / "local.zarr"
    build(photos, local, *SMALL, "--workers", "2")  # no file skipped, the same --shard-batches
    assert_same_tree(local, outputs[0])


def _interrupted_runs(source: Path, output: Path, rng: random.Random, *extra: str) -> list[str]:
    """Start the build and stop its whole process group at a random moment (from the first
    instant to past the publish), one to three times, then let it finish."""
    happened = []
    for _ in range(rng.randint(1, 3)):
        proc = start_cli("build", source, "-o", output, *SLOW, *extra, "--workers", "2", "--quiet")
        sig = rng.choice([signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
        time.sleep(rng.uniform(0.0, 2.5))
        kill_group(proc, sig)
        _, err = proc.communicate(timeout=60)
        assert wait_group_gone(proc.pid) == []
        assert proc.returncode in (0, -9, 128 + sig, -sig), err
        assert "Traceback" not in err, err
        happened.append(f"{sig.name} -> {proc.returncode}")
    build(source, output, *SLOW, *extra, "--workers", "2")
    return happened


def test_interrupted_and_resumed_builds_end_the_same_bytes(photos: Path, tmp_path: Path) -> None:
    whole = tmp_path / "whole.zarr"
    build(photos, whole, *SLOW, "--workers", "2")
    rng = sweep_rng("interrupted and resumed builds")
    stopped, trials = [], sweep(4, 10)
    for trial in range(trials):
        out = tmp_path / f"t{trial}.zarr"
        happened = _interrupted_runs(photos, out, rng)
        assert tree(out) == tree(whole), f"trial {trial}: {happened}"
        assert trial or run_cli("verify", out).returncode == 0
        stopped += [outcome for outcome in happened if not outcome.endswith("-> 0")]
    assert len(stopped) >= trials * 8 // 10, stopped  # most signals landed while the build ran


def test_the_same_change_to_copies_of_a_dataset_gives_the_same_bytes(photos: Path, tmp_path: Path) -> None:
    folder = tmp_path / "photos"
    shutil.copytree(photos, folder, copy_function=shutil.copy2)
    first = tmp_path / "a.zarr"
    build(folder, first, *SMALL, "--workers", "2")
    second = tmp_path / "b.zarr"
    shutil.copytree(first, second, copy_function=shutil.copy2)
    change_files(folder, 0)
    build(folder, first, *SMALL, "--workers", "2")
    build(folder, second, *SMALL, "--workers", "1")
    assert_same_tree(second, first)
    assert digest_of(first) == digest_of(second)
    # its digest was made from the hashes the last build kept for the shards kept whole, the
    # collator's for the shards it wrote, and the open tail's bytes read again: verify reads all
    assert run_cli("verify", first).returncode == 0


def test_the_digest_changes_with_one_input_byte(tmp_path: Path) -> None:
    folder = tmp_path / "arrays"
    folder.mkdir()
    for n in range(12):
        np.save(folder / f"a{n:02d}.npy", np.arange(16, dtype=np.float32) + n)
    first, second = tmp_path / "one.zarr", tmp_path / "two.zarr"
    build(folder, first, "--preprocess", "npy", "--batch-size", "4")
    victim = folder / "a05.npy"
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 1  # one bit of one value
    victim.write_bytes(bytes(raw))
    build(folder, second, "--preprocess", "npy", "--batch-size", "4")
    assert digest_of(first) != digest_of(second)
    third = tmp_path / "three.zarr"
    build(folder, third, "--preprocess", "npy", "--batch-size", "4", "--workers", "1")
    assert digest_of(third) == digest_of(second)
    group = third / "zarr.json"  # an attribute changed by hand: every checksum still holds, the digest not
    group.write_text(group.read_text().replace('"ignored": 0', '"ignored": 1'))
    result = run_cli("verify", third)
    assert result.returncode == 1 and "the content digest is" in result.stdout + result.stderr


def test_a_dataset_published_with_digest_2_still_verifies(tmp_path: Path) -> None:
    """Digest 3 hashes chunks with BLAKE3; a dataset an earlier batchctl published with digest 2
    (SHA-256 chunk hashes) still verifies, and its digest still catches a changed attribute."""
    folder = tmp_path / "arrays"
    folder.mkdir()
    for n in range(12):
        np.save(folder / f"a{n:02d}.npy", np.arange(16, dtype=np.float32) + n)
    out = tmp_path / "one.zarr"
    build(folder, out, "--preprocess", "npy", "--batch-size", "4")
    files = DatasetFiles(str(out))
    old, shards = content_digest(files, files.arrays(), batchctl.open(out).attrs, version=2)
    assert shards and all(found.startswith("sha256-chunks:") for found in shards.values())
    new = digest_of(out)
    assert old != new
    group = out / "zarr.json"
    group.write_text(group.read_text().replace(new, old))  # as digest 2 published it, with its notes
    record = (out / "batchctl.record").read_bytes().replace(new.encode(), old.encode())
    (out / "batchctl.record").write_bytes(record)
    info = json.loads((out / "batchctl.build.json").read_text())
    info.update(digest=old, shards=shards, record_sha256=hashlib.sha256(record).hexdigest())
    (out / "batchctl.build.json").write_text(json.dumps(info))
    assert digest_of(out) == old
    result = run_cli("verify", out)
    assert result.returncode == 0, result.stdout + result.stderr
    group.write_text(group.read_text().replace('"ignored": 0', '"ignored": 1'))
    result = run_cli("verify", out)
    assert result.returncode == 1 and f"not the {old} it was published with" in result.stdout + result.stderr


def test_a_build_interrupted_under_digest_2_resumes_to_the_same_bytes_and_digest(photos: Path, tmp_path: Path) -> None:
    """A nightly build stopped by the last batchctl (its journal's finished shards carry digest
    2's SHA-256 trees) and resumed by this one: those hashes are not used for the new digest
    (the shards are read again), and the dataset is the uninterrupted build's, digest included."""
    whole = tmp_path / "whole.zarr"
    build(photos, whole, *SLOW, "--workers", "2")
    out = tmp_path / "out.zarr"
    journal = tmp_path / ".out.zarr.batchctl" / "journal.jsonl"

    def hashed_shards() -> list[dict]:
        lines = [json.loads(text) for text in journal.read_text().splitlines()] if journal.exists() else []
        return [line for line in lines if "sha256" in line]

    proc = start_cli("build", photos, "-o", out, *SLOW, "--workers", "2", "--quiet")
    wait_for(lambda: len(hashed_shards()) >= 2)
    kill_group(proc, signal.SIGKILL)  # (nothing more is journaled)
    proc.communicate(timeout=60)
    assert wait_group_gone(proc.pid) == []
    staging = DatasetFiles(str(tmp_path / ".out.zarr.batchctl" / "staging.zarr"))
    arrays = staging.arrays()
    rewritten = []
    for text in journal.read_text().splitlines():
        line = json.loads(text)
        if "sha256" in line:  # as the last batchctl journaled a finished shard
            shard = line["shard_done"]
            line["sha256"] = {
                name: shard_file_hash(
                    staging, arrays[name].shard_key(shard), arrays[name].chunks_per_shard, OLD_SHARD_HASH
                )
                for name in line["sha256"]
            }
            assert all(found.startswith("sha256-chunks:") for found in line["sha256"].values())
        rewritten.append(json.dumps(line))
    journal.write_text("".join(f"{text}\n" for text in rewritten))
    build(photos, out, *SLOW, "--workers", "2")
    assert tree(out) == tree(whole)
    assert digest_of(out) == digest_of(whole)
    assert run_cli("verify", out).returncode == 0


def test_the_reorder_places_chunks_in_dispatch_order() -> None:
    """Chunks arriving in any order, one of them lost with its worker and handed out again."""
    order: list[int] = []
    reorder: Reorder[str] = Reorder()

    def arrive(tasks: tuple[int, ...]) -> None:
        if reorder.stale(tasks):
            return
        if reorder.due(tasks):
            order.extend(tasks)
            reorder.placed(tasks)
            while (due := reorder.take_due()) is not None:
                order.extend(due[0])
                reorder.placed(due[0])
        else:
            reorder.hold(tasks, "rows", 10)

    arrive((4, 5))
    arrive((2, 3))
    assert order == [] and reorder.bytes == 20
    arrive((0, 1))
    assert order == [0, 1, 2, 3, 4, 5] and reorder.bytes == 0
    arrive((7, 8))  # 6 was lost with its worker: the rest of its chunk came again without it
    arrive((2, 3))  # a second copy of a placed chunk is dropped
    assert order == [0, 1, 2, 3, 4, 5]
    reorder.lost([6])
    assert reorder.take_due() == ((7, 8), "rows")


def test_a_plugin_moved_to_another_folder_keeps_the_digest_and_no_path_is_published(
    photos: Path, tmp_path: Path
) -> None:
    first, second = tmp_path / "a" / "plugins.py", tmp_path / "b" / "elsewhere" / "plugins.py"
    for plugin in (first, second):
        plugin.parent.mkdir(parents=True)
        shutil.copy2(PLUGINS, plugin)
    options = ["--option", "delay=0", "--batch-size", "8", "--shard-batches", "2"]
    build(photos, tmp_path / "one.zarr", "--preprocess", f"{first}:slow_image", *options)
    build(photos, tmp_path / "two.zarr", "--preprocess", f"{second}:slow_image", *options)
    assert digest_of(tmp_path / "one.zarr") == digest_of(tmp_path / "two.zarr")
    documents = [p.read_text() for p in (tmp_path / "one.zarr").rglob("zarr.json")]
    assert not any(str(tmp_path) in text for text in documents)  # the plugin is named "plugins.py:slow_image"
    assert any('"plugins.py:slow_image"' in text for text in documents)
    moved = run_cli("build", photos, "-o", tmp_path / "one.zarr", "--preprocess", f"{second}:slow_image", *options)
    assert moved.returncode == 0 and "up to date" in moved.stderr, moved.stderr  # the same code: nothing to redo
