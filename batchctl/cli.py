"""The `batchctl` command: a thin layer that parses options, calls the library, prints, exits.

Exit codes: 0 success (or up to date), 1 failed build or bad dataset, 2 usage error,
130 interrupted by SIGINT (Ctrl-C), 143 terminated by SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn, Optional

import typer
from typer.core import TyperCommand

from batchctl.errors import BatchctlError, BuildFailed, BuildInterrupted, UsageError
from batchctl.progress import ConsoleProgress
from batchctl.report import BuildReport, count_of, size_text
from batchctl.run.signals import Signalled, check_signalled, signal_handled, signalled_in
from batchctl.store.storage import parse_storage_options
from batchctl.version import __version__

EXIT_CODES = """Exit codes: 0 success or up to date; 1 failed build; 2 usage error;
130 interrupted (SIGINT); 143 terminated (SIGTERM)."""
READ_EXIT_CODES = "Exit codes: 0 done; 1 not a batchctl dataset, or damaged (named); 2 usage error."
VERIFY_EXIT_CODES = "Exit codes: 0 OK; 1 a problem found (each named), or not a batchctl dataset; 2 usage error."


class Command(TyperCommand):
    """Usage lines as Unix tools write them: `batchctl build [OPTIONS] SOURCE` (Typer writes `{SOURCE}`)."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [piece.removeprefix("{").removesuffix("}") for piece in super().collect_usage_pieces(ctx)]


class Layout(StrEnum):
    hwc = "hwc"
    chw = "chw"


class Store(StrEnum):
    pixels = "pixels"
    jpeg = "jpeg"
    png = "png"


class Compression(StrEnum):
    auto = "auto"
    zstd = "zstd"
    blosc = "blosc"
    none = "none"


class Engine(StrEnum):
    local = "local"
    dask = "dask"


app = typer.Typer(
    help="Preprocess a folder of files once, offline, into sharded Zarr v3 batches.",
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    add_completion=True,  # --install-completion, --show-completion (bash, zsh, fish, PowerShell)
    rich_markup_mode=None,  # plain help that wraps at word boundaries in any width
)


def _fail(message: str, code: int) -> NoReturn:
    typer.echo(f"batchctl: error: {message}", err=True)
    raise typer.Exit(code)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"batchctl {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """batchctl: preprocess once, train from ready batches."""


STORAGE_OPTION = typer.Option(
    "--storage-option",
    metavar="KEY=VALUE",
    help="For a URL: an fsspec storage option key=value (repeatable; e.g. endpoint_url=http://host:9000, "
    "anon=true). Credentials otherwise come from the usual environment (AWS_ACCESS_KEY_ID, ...).",
)


@app.command(cls=Command, epilog=EXIT_CODES)
def build(
    source: Annotated[
        str,
        typer.Argument(
            metavar="SOURCE",
            help="Folder (or URL, s3://bucket/raw/) of input files, walked recursively (hidden ignored); "
            "or a table (.csv, .tsv, .jsonl, .parquet) whose rows name the files.",
        ),
    ],
    output: Annotated[
        Optional[str],
        typer.Option(
            "-o",
            "--output",
            metavar="PATH|URL",
            help="Where to write the Zarr v3 dataset: a path or a URL (s3://...). "
            "Default: SOURCE's name plus .zarr, beside it.",
        ),
    ] = None,
    batch_size: Annotated[int, typer.Option(help="Samples per batch (= rows per chunk).", min=1, metavar="N")] = 64,
    workers: Annotated[
        Optional[int], typer.Option(help="Preprocessing processes (default: all cores).", min=1, metavar="N")
    ] = None,
    preprocess: Annotated[
        str,
        typer.Option(
            metavar="NAME",
            help="image, audio, npy, text, or your own function: package.module:function or file.py:function.",
        ),
    ] = "image",
    include: Annotated[
        Optional[list[str]],
        typer.Option("--include", metavar="GLOB", help="Take only files matching this glob (repeatable)."),
    ] = None,
    label: Annotated[
        Optional[str],
        typer.Option(
            metavar="COLUMN",
            help="The column of metadata.csv/.jsonl/.parquet (beside the files), or of a table SOURCE, "
            "whose names or whole numbers are the class labels.",
        ),
    ] = None,
    path_column: Annotated[
        str,
        typer.Option(metavar="NAME", help="A table SOURCE's column naming each file (relative to the table)."),
    ] = "file_name",
    resize: Annotated[
        Optional[int], typer.Option(help="image: shorter side after resizing (default 256).", min=1, metavar="N")
    ] = None,
    crop: Annotated[
        Optional[int], typer.Option(help="image: side of the centre crop (default 224).", min=1, metavar="N")
    ] = None,
    layout: Annotated[Optional[Layout], typer.Option(help="image: pixel layout (default hwc).")] = None,
    store: Annotated[
        Optional[Store],
        typer.Option(
            help="image: store decoded pixels (default), or the image as JPEG or PNG for a loader to decode and "
            "crop at read time."
        ),
    ] = None,
    max_side: Annotated[
        Optional[int],
        typer.Option(help="image --store jpeg/png: longest side in pixels (default 512).", min=1, metavar="N"),
    ] = None,
    quality: Annotated[
        Optional[int], typer.Option(help="image --store jpeg: JPEG quality (default 90).", min=1, max=95, metavar="Q")
    ] = None,
    sample_rate: Annotated[
        Optional[int], typer.Option(help="audio: output rate in Hz (default 16000).", min=1, metavar="N")
    ] = None,
    clip_seconds: Annotated[
        Optional[float], typer.Option(help="audio: clip length (default 1.0).", min=0.001, metavar="SECONDS")
    ] = None,
    key: Annotated[Optional[str], typer.Option(help="npy: the array to take from .npz files.", metavar="NAME")] = None,
    split_rows: Annotated[bool, typer.Option("--split-rows", help="npy: each row along axis 0 is a sample.")] = False,
    option: Annotated[
        Optional[list[str]],
        typer.Option("--option", metavar="KEY=VALUE", help="Preprocessor option key=value (repeatable)."),
    ] = None,
    seed: Annotated[
        int,
        typer.Option(metavar="N", help="Seed of the shuffled order files are dispatched in (so batches mix classes)."),
    ] = 0,
    sorted_order: Annotated[
        bool, typer.Option("--sorted", help="Dispatch files in sorted path order instead of shuffled.")
    ] = False,
    shard_batches: Annotated[
        Optional[int], typer.Option(help="Batches per shard file (default: about 128 MiB).", min=1, metavar="N")
    ] = None,
    compression: Annotated[
        Compression,
        typer.Option(
            help="auto: zstd for the fields it shrinks to half or less, none for the rest; or one for "
            "every field. Every chunk is checksummed.",
        ),
    ] = Compression.auto,
    strict: Annotated[
        bool, typer.Option("--strict", help="Fail the build on any skipped file (= --max-errors 0).")
    ] = False,
    max_errors: Annotated[
        Optional[int], typer.Option(help="Fail once more than N files were skipped.", min=0, metavar="N")
    ] = None,
    resume: Annotated[bool, typer.Option(help="Resume an interrupted build of OUTPUT.")] = True,
    force: Annotated[bool, typer.Option("--force", help="Rebuild everything, even when OUTPUT is up to date.")] = False,
    checksum: Annotated[
        bool,
        typer.Option(
            "--checksum",
            help="Compare files by content hash (SHA-256) instead of size and mtime, for filesystems whose "
            "mtimes cannot be trusted; every file is read to hash it.",
        ),
    ] = False,
    timeout: Annotated[
        Optional[float],
        typer.Option(
            help="Seconds one file may take; a slower one is killed and skipped.", min=0.001, metavar="SECONDS"
        ),
    ] = None,
    report: Annotated[
        Optional[Path], typer.Option(help="Write a JSON report of the build here.", metavar="FILE")
    ] = None,
    storage_option: Annotated[Optional[list[str]], STORAGE_OPTION] = None,
    engine: Annotated[
        Engine, typer.Option(help="local (a process pool on this machine) or dask (a dask.distributed cluster).")
    ] = Engine.local,
    scheduler: Annotated[
        Optional[str],
        typer.Option(
            metavar="ADDRESS",
            help="--engine dask: the scheduler's address, tcp://HOST:PORT (default: a local cluster).",
        ),
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print only errors.")] = False,
) -> None:
    """Preprocess every file under SOURCE into batches and write them to OUTPUT (a folder, or a URL
    of an object store such as s3://bucket/data.zarr)."""
    progress = ConsoleProgress(quiet=quiet)
    # the Python API's keywords are these options' names: it maps them (build.build_options)
    options: dict[str, Any] = {
        "batch_size": batch_size,
        "preprocess": preprocess,
        "include": include,
        "label": label,
        "path_column": path_column,
        "resize": resize,
        "crop": crop,
        "layout": layout.value if layout is not None else None,
        "store": store.value if store is not None else None,
        "max_side": max_side,
        "quality": quality,
        "sample_rate": sample_rate,
        "clip_seconds": clip_seconds,
        "key": key,
        "split_rows": split_rows,
        "option": option,
        "seed": seed,
        "sorted": sorted_order,
        "shard_batches": shard_batches,
        "compression": compression.value,
        "strict": strict,
        "max_errors": max_errors,
        "resume": resume,
        "force": force,
        "checksum": checksum,
        "timeout": timeout,
        "storage_option": storage_option,
        "engine": engine.value,
        "scheduler": scheduler,
    }
    if workers is not None:
        options["workers"] = workers
    try:
        _check_writable_destination(report, "--report")
        from batchctl.build import build as run_build

        check_signalled()  # one that came during those imports, should a library have swallowed it
        result = run_build(source, output, progress=progress, **options)
    except BuildInterrupted as exc:
        signal_handled()
        _finish(exc.report, report, quiet)
        typer.echo("batchctl: interrupted; rerun the same command to resume.", err=True)
        raise typer.Exit(128 + exc.signum) from None
    except BuildFailed as exc:
        _finish(exc.report, report, quiet)
        _fail(str(exc), 1)
    except UsageError as exc:
        _fail(str(exc), 2)
    except BatchctlError as exc:
        _fail(str(exc), 1)
    _finish(result, report, quiet)


@app.command(cls=Command, epilog=READ_EXIT_CODES)
def info(
    path: Annotated[str, typer.Argument(help="A batchctl dataset: a path or a URL.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    storage_option: Annotated[Optional[list[str]], STORAGE_OPTION] = None,
) -> None:
    """Show counts, fields, layout, compression, size on disk, classes and build options."""
    from batchctl.read.inspect import info as read_info

    try:
        data = read_info(path, parse_storage_options(storage_option or []))
    except BatchctlError as exc:
        _fail(str(exc), 1)
    except OSError as exc:  # a store that cannot be reached, a refusal, missing credentials
        _fail(exc.strerror or str(exc), 1)
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    typer.echo(_describe(data))


def _last_batch(data: dict[str, Any]) -> str:
    """What the short last stored batch holds, where it is short."""
    last = data["num_samples"] - (data["num_batches"] - 1) * data["batch_size"]
    if not data["num_batches"] or last == data["batch_size"]:
        return ""
    return f" (holding {last})" if data["num_batches"] == 1 else f" (the last holds {last})"


def _why_ignored(data: dict[str, Any], path: str) -> str:
    """A file beside the class folders has no class: say so (the others' reasons are the listed kinds)."""
    return " (beside the class folders: it has no class)" if data["classes"] and "/" not in path else ""


def _describe(data: dict[str, Any]) -> str:
    lines = [
        f"{data['path']}: {'complete' if data['complete'] else 'NOT COMPLETE'}",
        f"  {count_of(data['num_samples'], 'sample')}, "
        f"{count_of(data['num_batches'], 'batch')} of {data['batch_size']}{_last_batch(data)}, "
        f"{count_of(data['num_shards'], 'shard')} (up to {data['shard_batches']} batches each), "
        f"{size_text(data['bytes'])} on disk",
        f"  compression {data['compression']}; preprocess {json.dumps(data['preprocess'])}",
        f"  digest {data['digest'] or '(none: an older format)'}",
        f"  built by batchctl {data['batchctl_version']} from {data['source']}"
        if data["batchctl_version"]
        else "  built by an older batchctl (no build info)",
        f"  skipped with errors {data['errors']}, ignored {data['ignored']}",
        "  fields:",
    ]
    for name, f in data["fields"].items():
        ratio = f" ratio {f['ratio']}x" if f["ratio"] else ""
        what = f" ({f['note']})" if f.get("note") else ""
        lines.append(
            f"    {name:<14} {str(tuple(f['shape'])):<16} {f['dtype']:<8} chunk {f['chunk_rows']} rows, "
            f"shard {f['shard_rows']} rows, {'+'.join(f['codecs'])}, {size_text(f['stored_bytes'])}{ratio}{what}"
        )
    if data["class_counts"]:
        lines.append("  classes: " + ", ".join(f"{k} {v}" for k, v in data["class_counts"].items()))
    if data["skipped"]:
        lines.append("  skipped:")
        lines += [f"    {entry['source']}: {entry['error']}" for entry in data["skipped"][:SKIPPED_SHOWN]]
        if data["errors"] > SKIPPED_SHOWN:
            lines.append(f"    ... and {data['errors'] - SKIPPED_SHOWN} more (info --json lists up to 1000)")
    if data["ignored_paths"]:
        lines.append("  ignored (not taken by the preprocessor, not regular files, or outside the class folders):")
        lines += [f"    {path}{_why_ignored(data, path)}" for path in data["ignored_paths"][:SKIPPED_SHOWN]]
        if data["ignored"] > SKIPPED_SHOWN:
            lines.append(f"    ... and {data['ignored'] - SKIPPED_SHOWN} more (info --json lists up to 1000)")
    return "\n".join(lines)


SKIPPED_SHOWN = 20


@app.command(cls=Command, epilog=VERIFY_EXIT_CODES)
def verify(
    path: Annotated[str, typer.Argument(help="A batchctl dataset: a path or a URL.")],
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Print only problems.")] = False,
    storage_option: Annotated[Optional[list[str]], STORAGE_OPTION] = None,
) -> None:
    """Read every chunk of every array: checksums, shapes, counts, unique sources. Exit 1 on any problem."""
    from tqdm import tqdm

    from batchctl.read.inspect import verify as run_verify
    from batchctl.read.reader import open as open_dataset

    try:
        storage_options = parse_storage_options(storage_option or [])
        total = open_dataset(path, allow_partial=True, storage_options=storage_options).num_batches
        with tqdm(total=total, desc="verify", unit="batch", disable=quiet or not sys.stderr.isatty()) as bar:
            problems = run_verify(path, on_batch=bar.update, storage_options=storage_options)
    except BatchctlError as exc:
        _fail(str(exc), 1)
    except OSError as exc:  # a store that cannot be reached, a refusal, missing credentials
        _fail(exc.strerror or str(exc), 1)
    for problem in problems:
        typer.echo(f"batchctl: bad: {problem}", err=True)
    if problems:
        _fail(f"{path}: {count_of(len(problems), 'problem')} found", 1)
    if not quiet:
        typer.echo(f"{path}: OK ({total} batches read and checked)", err=True)


@app.command(cls=Command, epilog=READ_EXIT_CODES)
def preview(
    path: Annotated[str, typer.Argument(help="A batchctl dataset: a path or a URL.")],
    output: Annotated[Path, typer.Option("-o", "--output", metavar="FILE", help="PNG file to write.")],
    batch: Annotated[int, typer.Option(help="Which batch to show.", min=0, metavar="N")] = 0,
    count: Annotated[int, typer.Option(help="How many samples of it.", min=1, metavar="N")] = 16,
    storage_option: Annotated[Optional[list[str]], STORAGE_OPTION] = None,
) -> None:
    """Draw samples of one batch into a PNG grid, captioned with their class (or file) names."""
    from batchctl.read.preview import preview as draw_preview

    try:
        _check_writable_destination(output, "-o")
        if output.suffix.lower() != ".png":
            raise UsageError(f"Expected -o to name a .png file, got {str(output)!r} instead.")
        options = parse_storage_options(storage_option or [])
        drawn = draw_preview(path, output, batch=batch, count=count, storage_options=options)
    except UsageError as exc:
        _fail(str(exc), 2)
    except BatchctlError as exc:
        _fail(str(exc), 1)
    except OSError as exc:  # a store that cannot be reached, a refusal, missing credentials
        _fail(exc.strerror or str(exc), 1)
    if isinstance(drawn, str):  # neither images nor audio: the rows themselves
        typer.echo(drawn)
        typer.echo(f"{path} has no image or audio field to draw: batch {batch}'s first rows above", err=True)
        return
    typer.echo(f"wrote {drawn} samples of batch {batch} to {output}", err=True)


def _check_writable_destination(path: Path | None, option: str) -> None:
    """A file the command will write at the end: its folder must exist and be writable now,
    before any work, not after a long build."""
    if path is None:
        return
    folder = path.absolute().parent
    if not folder.is_dir():
        raise UsageError(f"{option} {path}: the folder {folder} does not exist.")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{option} {path}: the folder {folder} is not writable.")
    if path.is_dir():
        raise UsageError(f"{option} {path} is a folder; name a file.")


def _finish(result: BuildReport, report_path: Path | None, quiet: bool) -> None:
    result.time_before_build()
    if report_path is not None:
        result.write(report_path)
    if not quiet:
        typer.echo(result.summary(), err=True)


def run() -> None:
    """Console-script entry point (`batchctl.__main__` has installed the signal handlers).

    Click runs without its standalone mode so that its usage errors print like batchctl's own:
    one line, `batchctl: error: ...`, exit 2."""
    try:
        code = app(standalone_mode=False)
    except typer.TyperException as exc:  # Click's errors (a usage error's exit code is 2)
        if type(exc).__name__ == "NoArgsIsHelpError":  # `batchctl` alone: the help, as Click shows it
            typer.echo(exc.format_message(), err=True)
            sys.exit(2)
        ctx = getattr(exc, "ctx", None)
        hint = f" (see: {ctx.command_path} --help)" if ctx is not None else ""
        message = " ".join(exc.format_message().split())
        typer.echo(f"batchctl: error: {message}{hint}", err=True)
        code = getattr(exc, "exit_code", 2)
    except typer.Abort:  # Click's own handling of an end of input
        code = 1
    except (Signalled, Exception) as exc:  # a signal while parsing or starting: no traceback, 130/143
        signalled = signalled_in(exc)
        if signalled is None:
            raise
        signal_handled()
        typer.echo("batchctl: interrupted.", err=True)
        code = 128 + signalled.signum
    finally:  # the command is over: a signal from now on must not raise inside interpreter exit
        for stop in (signal.SIGINT, signal.SIGTERM):
            signal.signal(stop, signal.SIG_IGN)
    sys.exit(code if isinstance(code, int) else 0)
