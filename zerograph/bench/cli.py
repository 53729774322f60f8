"""The bench's command line: its flags, their validation before any rank starts, and the launch.

``validate_args`` checks every flag (ranges, the model or factory, divisibility of the batch, the
clusters, the output paths) in the calling process, so a bad input costs one line on stderr and
exit status 2 (argparse's convention), never a launch. ``run`` then starts ``--nproc`` ranks
(or, under torchrun, is one) and reports; when a rank fails, its own exception is the first
thing printed, in a few lines (``describe_rank_failure``).

Source: ``argparse``; ``torch.distributed.launcher.api.elastic_launch`` (the engine of torchrun)
and its ``ChildFailedError`` / ``ProcessFailure`` error files.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from typing import Any

import torch

from ..config import Config
from ..errors import ConfigError
from ..graph.costmodel import CLUSTERS_FILE, load_cluster_table
from .real_models import REAL_MODELS
from .report import report
from .runner import rank_main
from .simulation import LOCAL_CLUSTER, cluster_links
from .systems import GRAMMAR, check_world_size, parse_systems
from .workloads import example_gpt, load_factory, real_model_size

DEFAULT_SYSTEMS = ("zerograph-s0,zerograph-s1,zerograph-s2,zerograph-s3,zerograph-s3-noov,"
                   "ddp,fsdp2,fsdp2-compile")
_MESSAGE_LINES = 8  # lines of a failed rank's exception message shown (the full text is in its error file)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the bench's flags on ``parser`` (``zerograph bench`` and ``python -m zerograph.bench``)."""
    defaults = Config()
    parser.add_argument("--model", default="small",
                        help="GPT example size (tiny, small, medium, gpt2-124m), a real model (hf-gpt2, hf-llama, "
                             "titan-llama; width 512 x 4 blocks x 128 tokens unless --n-embd / --n-layer / --seq-len), "
                             "or module:factory (see the module docstring)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks to launch (ignored under torchrun)")
    parser.add_argument("--start-method", choices=("spawn", "forkserver"), default="spawn",
                        help="how the --nproc ranks start, as torchrun's flag: spawn (new interpreters) or forkserver "
                             "(children of multiprocessing's fork server, which has imported what its preload names)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per system")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first one compiles)")
    parser.add_argument("--profile-steps", type=int, default=3, help="profiled steps after the timed ones")
    parser.add_argument("--systems", default=DEFAULT_SYSTEMS,
                        help=f"comma-separated, each {GRAMMAR}, ddp, fsdp2 or fsdp2-compile (docs/bench.md)")
    parser.add_argument("--json", dest="json_path", metavar="PATH", help="write every raw figure here")
    parser.add_argument("--png", dest="png_path", metavar="PATH", help="write the step-time chart here")
    parser.add_argument("--prefetch-depth", type=int, default=defaults.schedule.prefetch_depth,
                        help="zerograph SchedulePolicy.prefetch_depth (units)")
    parser.add_argument("--bucket-bytes", type=int, default=defaults.schedule.bucket_bytes,
                        help="zerograph SchedulePolicy.bucket_bytes (bytes)")
    parser.add_argument("--batch-size", type=int, default=16, help="global batch, sequences (split over ranks)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence; sets the GPT's block_size (default its size's)")
    parser.add_argument("--n-layer", type=int, help="blocks of the GPT example (default its size's)")
    parser.add_argument("--n-embd", type=int, help="width of the GPT example (default its size's)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seeds the model init and the batches")
    parser.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                        help="process-group backend: auto is nccl when CUDA is present, else gloo; gloo with CUDA "
                             "lets several ranks share one GPU (ranks map to GPUs round-robin), for memory figures")
    parser.add_argument("--simulate", metavar="CLUSTER[,CLUSTER]",
                        help=f"project zerograph's measured profiles onto clusters from --clusters, or '{LOCAL_CLUSTER}'")
    parser.add_argument("--clusters", default=str(CLUSTERS_FILE), metavar="PATH",
                        help="JSON table of clusters for --simulate (default: the packaged clusters.json)")


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m zerograph.bench`` (``zerograph bench`` registers the same flags)."""
    description = sys.modules[__package__].__doc__  # the package's docstring documents the flags

    parser = argparse.ArgumentParser(prog="zerograph bench", description=description.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse ``argv`` (``sys.argv[1:]`` when ``None``) and ``run``. Returns the exit status."""
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the benchmark for parsed ``args``; 0 on success, 1 when a rank failed, 2 on bad input.

    Under torchrun (``RANK`` and ``WORLD_SIZE`` set) this process is one rank and rank 0 reports;
    otherwise ``--nproc`` ranks are launched with ``torch.distributed.launcher`` (the engine of
    torchrun) and this process reports what rank 0 returns. Every flag is validated first
    (``validate_args``): a bad one prints one line naming it and returns 2 before anything starts.
    """
    try:
        validate_args(args)
    except ConfigError as exc:
        print(f"zerograph bench: {exc}", file=sys.stderr)
        return 2
    options = vars(args).copy()
    options.pop("handler", None)  # set when called through the zerograph CLI; not picklable
    options["command_line"] = " ".join(argv_of(args))
    if _under_torchrun():
        result = rank_main(options)
        if result is not None:
            report(result, args)
        return 0
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        results = launch(options, args.nproc, args.start_method)
    except ChildFailedError as exc:
        # on a line of its own: rank 0's progress bar, stopped mid-line, may hold the cursor
        print("\n" + describe_rank_failure(exc), file=sys.stderr)
        return 1
    report(results[0], args)
    return 0


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def validate_args(args: argparse.Namespace) -> None:
    """Check every flag of ``args`` before any rank starts; raises ``ConfigError`` whose one-line
    message names the flag. Imports a ``--model module:factory`` (not calling it) and tries the
    ``--json`` / ``--png`` paths (a file created for the test is removed again)."""
    if args.backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("--backend nccl needs CUDA; this machine has none")
    for name in ("nproc", "steps", "batch_size"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("seq_len", "n_layer", "n_embd"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("warmup", "profile_steps", "prefetch_depth", "bucket_bytes"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not (math.isfinite(args.lr) and args.lr >= 0):
        raise ConfigError(f"--lr must be a finite number >= 0, got {args.lr}")
    specs = parse_systems(args.systems, args.prefetch_depth, args.bucket_bytes)
    world_size = int(os.environ["WORLD_SIZE"]) if _under_torchrun() else args.nproc
    for spec in specs:
        check_world_size(spec, world_size)
    if ":" in args.model:
        load_factory(args.model)  # its batches are its own: --batch-size and --seq-len do not apply
        if args.n_layer is not None or args.n_embd is not None:
            raise ConfigError("--n-layer / --n-embd change the GPT example's size; a module:factory builds its own")
    else:
        sizes = example_gpt().SIZES
        if args.model in REAL_MODELS:
            real_model_size(args.n_embd, args.n_layer, args.seq_len)
        elif args.model not in sizes:
            raise ConfigError(f"--model: unknown GPT size {args.model!r}; known: {sorted(sizes)}, the real models "
                              f"{', '.join(REAL_MODELS)} (or module:factory)")
        elif args.n_embd is not None and args.n_embd % sizes[args.model].n_head:
            raise ConfigError(f"--n-embd {args.n_embd} must be a multiple of the {args.model} GPT's "
                              f"{sizes[args.model].n_head} heads")
        if args.batch_size % world_size:
            raise ConfigError(f"--batch-size {args.batch_size} must be divisible by the number of ranks "
                              f"{world_size} (--nproc): the ranks take equal parts of the global batch")
    _check_devices(args)
    if args.simulate:
        _check_clusters(args.simulate, args.clusters)
    _check_outputs(args.json_path, args.png_path)


def _check_devices(args: argparse.Namespace) -> None:
    """NCCL refuses two ranks on one GPU (``--backend gloo`` lets them share it)."""
    if _under_torchrun() or not torch.cuda.is_available() or args.backend == "gloo":
        return
    gpus = torch.cuda.device_count()
    if args.nproc > gpus:
        raise ConfigError(f"--nproc {args.nproc}: NCCL needs a GPU per rank and this machine has {gpus}; "
                          "use --nproc <= that, or --backend gloo to share GPUs")


def _check_clusters(simulate: str, clusters_path: str) -> None:
    names = [n for n in simulate.split(",") if n != LOCAL_CLUSTER]
    table = load_cluster_table(clusters_path)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ConfigError(f"--simulate: unknown cluster(s) {unknown} in {clusters_path}; known: "
                          f"{sorted(table)} and '{LOCAL_CLUSTER}'")
    for name in names:
        try:
            cluster_links(table[name])
        except ConfigError as exc:
            raise ConfigError(f"--simulate {name}: {exc}") from exc


def _check_outputs(json_path: str | None, png_path: str | None) -> None:
    """Refuse output paths that could not be written after the run, which would lose its results."""
    if json_path and png_path and os.path.abspath(json_path) == os.path.abspath(png_path):
        raise ConfigError(f"--json and --png are the same file {json_path}")
    if png_path:
        from matplotlib.backend_bases import FigureCanvasBase

        suffix = os.path.splitext(png_path)[1].lstrip(".").lower()
        supported = FigureCanvasBase.get_supported_filetypes()
        if suffix and suffix not in supported:
            raise ConfigError(f"--png {png_path}: matplotlib cannot write .{suffix} files; use one of "
                              f"{', '.join(sorted(supported))}")
    for flag, path in (("--json", json_path), ("--png", png_path)):
        if path:
            check_writable(flag, path)


def check_writable(flag: str, path: str) -> None:
    """Raise ``ConfigError`` unless ``path`` can be opened for writing: its directory exists, it is
    not a directory, and the file system lets this process create or append to it. Tried for real
    (permission bits do not tell for root or a read-only mount); a file created here is removed."""
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path}: is a directory")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ConfigError(f"{flag} {path}: directory {parent} does not exist")
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot be written ({exc.strerror or exc})") from exc
    if not existed:
        os.remove(path)


def argv_of(args: argparse.Namespace) -> list[str]:
    """The flags that differ from their defaults: the command that reproduces this run."""
    out = []
    for action in build_parser()._actions:
        value = getattr(args, action.dest, None)
        if action.option_strings and action.dest != "help" and value is not None and value != action.default:
            out += [action.option_strings[0], str(value)]
    return out


def launch(options: dict, nproc: int, start_method: str = "spawn") -> dict[int, Any]:
    """Start ``nproc`` local ranks running ``rank_main(options)`` by ``start_method`` (``spawn`` or
    ``forkserver``, ``torch.multiprocessing.start_processes``'); returns ``{rank: result}``.
    Raises ``ChildFailedError`` when a rank fails (the others are stopped)."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"zerograph-bench-{os.getpid()}",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0,
                          monitor_interval=0.1, start_method=start_method)
    # the agent's INFO lines would bury the table, and on a failure its ERROR line repeats the rank's
    # whole traceback and spawn warns of each peer it stops: describe_rank_failure says it in a few lines
    quiet = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.multiprocessing.spawn")]
    levels = [log.level for log in quiet]
    for log in quiet:
        log.setLevel(logging.CRITICAL)
    try:
        return elastic_launch(config, rank_main)(options)
    finally:
        for log, level in zip(quiet, levels):
            log.setLevel(level)


def describe_rank_failure(exc: Any) -> str:
    """A few lines for a ``ChildFailedError``: first the failed rank's own exception (type and
    message), then where it was raised, the other ranks' fate, and the error file holding the full
    traceback. The rank chosen is the earliest that raised (signal-stopped ranks come last)."""
    def order(item: tuple[int, Any]) -> tuple[bool, int, int]:
        rank, failure = item
        return (not isinstance(failure.message, dict), failure.timestamp, rank)

    rank, failure = min(exc.failures.items(), key=order)
    message = failure.message["message"] if isinstance(failure.message, dict) else str(failure.message)
    lines = message.splitlines() or ["(no message)"]
    if len(lines) > _MESSAGE_LINES:
        lines = [*lines[:_MESSAGE_LINES], f"... ({len(lines) - _MESSAGE_LINES} more lines in the error file)"]
    out = [f"zerograph bench: rank {rank} failed: {lines[0]}", *(f"  {line}" for line in lines[1:])]
    where = _raise_site(failure)
    if where:
        out.append(f"  raised at {where}")
    others = [f"rank {r}: {_one_line(f)}" for r, f in sorted(exc.failures.items()) if r != rank]
    if others:
        out.append("  other ranks: " + "; ".join(others))
    if os.path.isfile(failure.error_file):
        out.append(f"  full traceback: {failure.error_file}")
    return "\n".join(out)


def _raise_site(failure: Any) -> str | None:
    """``file:line in function`` of the innermost frame of the failure's recorded traceback."""
    if not isinstance(failure.message, dict):
        return None
    stack = failure.message.get("extraInfo", {}).get("py_callstack", "")
    frames = [line.strip() for line in stack.splitlines() if line.strip().startswith('File "')]
    if not frames:
        return None
    # 'File "/path/x.py", line 9, in forward' -> '/path/x.py:9 in forward'
    path, _, rest = frames[-1][len('File "'):].partition('", line ')
    number, _, function = rest.partition(", in ")
    return f"{path}:{number} in {function}"


def _one_line(failure: Any) -> str:
    message = failure.message["message"] if isinstance(failure.message, dict) else str(failure.message)
    return (message.splitlines() or ["(no message)"])[0]
