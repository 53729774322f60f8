"""First-step (compile) time against depth: zerograph's eager and Inductor lowerings beside FSDP2 +
``torch.compile``, cold and warm, side by side (docs/benchmarks.md, "Compile time").

    python examples/compile_time.py --blocks 4,16,32,64 --json compile_time.json
    python examples/compile_time.py --one-rank --blocks 8,64     # CPU seconds and per-pass ms, in process
    python examples/compile_time.py --one-rank --templates-only --blocks 4,32,64

Each (system, depth) runs ``zerograph bench`` in a fresh process group of ``--nproc`` CPU ranks
(gloo) on a narrow GPT (``--n-embd``, default 64), so no in-process cache of an earlier run helps
it. *Cold*: a new, empty Inductor cache directory (``TORCHINDUCTOR_CACHE_DIR``); *warm*: the same
command again on the cache the cold run left, which is what a restart from a checkpoint sees
(PyTorch's FX graph cache and AOTAutograd cache; the eager lowering has no cache across
processes, so its warm run is measured as a control). Reported per run: the first step's seconds
(compile included, the slowest rank), the median / min / max of the timed steps, and the peak
memory over the baseline (the bench's definitions). Nothing here is asserted: it measures.

``--one-rank``: instead, rank 0 of a fake world of 2 (``zerograph.fake_world``) in this process,
zerograph stage 3 with the eager lowering only, without and with ``Config.unit_templates``: the
CPU seconds (``time.process_time``, robust to other jobs on the machine) of compile + first
forward + backward, Dynamo's and AOTAutograd's shares of them
(``torch._dynamo.utils.compilation_time_metrics``), the graphs' node counts, and with
``--passes`` each pass's milliseconds on each graph (``GraphModule.meta["zerograph_passes"]``, as
the dump's summary shows them).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

SYSTEMS = {"zerograph eager": "zerograph-s3-notpl", "zerograph eager + templates": "zerograph-s3-tpl",
           "zerograph inductor": "zerograph-s3-inductor-notpl", "zerograph inductor + templates": "zerograph-s3-inductor-tpl",
           "zerograph inductor + templates + islands": "zerograph-s3-inductor-islands-tpl",
           "FSDP2 + torch.compile": "fsdp2-compile"}


def run_bench(system: str, blocks: int, args: argparse.Namespace, cache_dir: str) -> dict:
    """One ``zerograph bench`` launch of ``system`` at ``blocks`` blocks; its JSON record."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as out:
        path = out.name
    command = [sys.executable, "-m", "zerograph.bench", "--model", "tiny", "--n-layer", str(blocks),
               "--n-embd", str(args.n_embd), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
               "--nproc", str(args.nproc), "--steps", str(args.steps), "--warmup", "1", "--profile-steps", "1",
               "--systems", system, "--json", path]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, OMP_NUM_THREADS="1")
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(path) as f:
        record = json.load(f)["systems"][system]
    os.unlink(path)
    return {"first_step_s": record["warmup_s"][0], "median_s": record["median_s"], "min_s": record["min_s"],
            "max_s": record["max_s"], "peak_memory_bytes": record["peak_memory_bytes"]}


def one_rank(blocks: int, args: argparse.Namespace, unit_templates: bool) -> dict:
    """Compile + first step of a stage-3 GPT of ``blocks`` blocks as rank 0 of a fake world of 2,
    with ``Config.unit_templates`` as given; also Dynamo's and AOTAutograd's shares of it."""
    import time

    import torch

    import zerograph
    from zerograph.models.gpt import GPT, GPTConfig
    from zerograph.passes.manager import PASS_TIMES
    from zerograph.runtime.state import graphs_of

    torch.set_num_threads(1)
    with zerograph.fake_world(2, 0):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=blocks, n_embd=args.n_embd, n_head=4, block_size=args.seq_len))
        idx = torch.randint(0, 256, (args.batch_size // 2, args.seq_len))
        start = time.process_time()
        torch._dynamo.utils.reset_frame_count()
        torch._dynamo.utils.compilation_time_metrics.clear()
        model = zerograph.compile(model, 3, config=zerograph.Config(lowering="eager", unit_templates=unit_templates))
        model(idx, idx).backward()
        seconds = time.process_time() - start
        passes = {kind: gm.meta[PASS_TIMES] for kind, gm in graphs_of(model)[0].items() if PASS_TIMES in gm.meta}
        phases = {name: sum(times) for name, times in torch._dynamo.utils.compilation_time_metrics.items()
                  if name in ("bytecode_tracing", "aot_trace_joint_graph", "aot_collect_metadata")}
        nodes = {kind: len(gm.graph.nodes) for kind, gm in graphs_of(model)[0].items()}
    return {"first_step_cpu_s": seconds, "passes": passes, "phases_s": phases, "nodes": nodes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", default="4,16,32,64", help="comma-separated depths")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of: {', '.join(SYSTEMS)}")
    parser.add_argument("--inductor-max-blocks", type=int, default=32,
                        help="skip zerograph's Inductor lowering above this depth (it costs ~2 s per block)")
    parser.add_argument("--no-warm", action="store_true", help="cold runs only")
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", dest="json_path", help="write every figure here")
    parser.add_argument("--one-rank", action="store_true", help="measure one rank in process (see above)")
    parser.add_argument("--passes", action="store_true", help="with --one-rank: print each pass's milliseconds")
    parser.add_argument("--templates-only", action="store_true", help="with --one-rank: skip the per-parameter build")
    args = parser.parse_args()
    blocks = [int(b) for b in args.blocks.split(",")]
    if args.one_rank:
        one_rank(1, args, True)  # warm-up: the process's first compile pays one-time imports and registrations
        builds = (True,) if args.templates_only else (False, True)
        runs = {f"{b}{' templates' if t else ''}": one_rank(b, args, t) for b in blocks for t in builds}
        for name, run in runs.items():
            phases = ", ".join(f"{k} {v:.1f} s" for k, v in run["phases_s"].items())
            print(f"{name} blocks: compile + first step {run['first_step_cpu_s']:.1f} CPU s ({phases}); "
                  f"nodes {run['nodes']}")
            if args.passes:
                for kind, times in run["passes"].items():
                    passes = ", ".join(f"{n} {1e3 * t:.0f}" for n, t in times["seconds"].items())
                    print(f"  {kind} ({times['nodes_in']} -> {times['nodes_out']} nodes), ms: {passes}")
        if args.json_path:
            with open(args.json_path, "w") as f:
                json.dump({"args": vars(args), "one_rank": runs}, f, indent=1)
        return
    names = [s.strip() for s in args.systems.split(",")]
    results: dict[str, dict[int, dict]] = {name: {} for name in names}
    for name in names:
        for depth in blocks:
            if name.startswith("zerograph inductor") and depth > args.inductor_max_blocks:
                continue
            with tempfile.TemporaryDirectory(prefix="zg-inductor-cache-") as cache:
                row = {"cold": run_bench(SYSTEMS[name], depth, args, cache)}
                if not args.no_warm:
                    row["warm"] = run_bench(SYSTEMS[name], depth, args, cache)
            results[name][depth] = row
            print(f"{name:22s} {depth:3d} blocks: first step cold {row['cold']['first_step_s']:.1f} s"
                  + (f", warm {row['warm']['first_step_s']:.1f} s" if "warm" in row else ""), file=sys.stderr, flush=True)
    print(table(results, blocks))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


def table(results: dict[str, dict[int, dict]], blocks: list[int]) -> str:
    """Markdown: first step cold / warm per depth and system, then the steady step and peak memory."""
    lines = ["| system | " + " | ".join(f"{b} blocks: first step cold / warm (s)" for b in blocks)
             + " | step at the deepest, median (min-max) ms | peak memory at the deepest (MB) |",
             "|---|" + "---:|" * len(blocks) + "---:|---:|"]
    for name, rows in results.items():
        cells = []
        for b in blocks:
            row = rows.get(b)
            if row is None:
                cells.append("-")
                continue
            warm = f" / {row['warm']['first_step_s']:.1f}" if "warm" in row else ""
            cells.append(f"{row['cold']['first_step_s']:.1f}{warm}")
        deepest = rows[max(rows)]["cold"] if rows else None
        step = (f"{1e3 * deepest['median_s']:.0f} ({1e3 * deepest['min_s']:.0f}-{1e3 * deepest['max_s']:.0f})"
                if deepest else "-")
        memory = f"{deepest['peak_memory_bytes'] / 1e6:.0f}" if deepest else "-"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {step} | {memory} |")
    firsts = {name: {b: r["cold"]["first_step_s"] for b, r in rows.items()} for name, rows in results.items()}
    for name, by_depth in firsts.items():
        if len(by_depth) > 1:
            low, high = min(by_depth), max(by_depth)
            lines.append(f"\n{name}: first step at {high} blocks / at {low} blocks = "
                         f"{by_depth[high] / by_depth[low]:.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
