"""The bench's output: the text tables, the JSON of every raw figure, the step-time chart (PNG),
and the definitions and machine description written into the JSON.

Source: matplotlib's object-oriented ``Figure`` API (no display needed).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .simulation import LOCAL_CLUSTER

MIB = 2**20


DEFINITIONS = {
    "step_time": "wall time of one step (forward, backward, AdamW step, zero_grad) from a barrier to its end "
                 "(after cuda synchronize on GPU); each step counts as its slowest rank",
    "exposed_comm": "torch.profiler over the profiled steps: time some collective is in flight (gloo's worker-"
                    "thread event on CPU, NCCL kernels on GPU) while the training thread runs no compute op "
                    "(outermost operator events other than c10d/_c10d_functional launches and waits); median "
                    "over profiled steps, mean over ranks",
    "peak_memory": "CPU: peak RSS (VmHWM reset after warm-up) over the timed steps minus RSS before the system "
                   "was built; GPU: max_memory_allocated over the timed steps minus the allocation before the "
                   "build; max over ranks; before any system, one tiny model of each kind of system was built and "
                   "stepped (prime_systems), so one-time process costs are in every baseline",
    "allocated": "torch.profiler(profile_memory=True) over separate profiled steps: peak of the running sum of "
                 "the device allocator's allocations minus frees within each step (bytes above the step's start; "
                 "median over steps); state: bytes held at the step's start counted from tensors, each storage "
                 "once: local parameter shards (DTensor to_local, padded storage), .grad, optimizer state tensors, "
                 "module buffers, comm buffers kept across steps (zerograph's buffer pool, DDP's gradient buckets); "
                 "state + peak = the step's peak allocated bytes; max over ranks",
    "comm_volume": "elements of the full tensors moved per step, all-reduce counted twice (ZeRO paper section 7); "
                   "zerograph from zerograph.report.stats, baselines counted by a dispatch mode over one step; divided "
                   "by psi (unique parameters)",
}


def machine_description(device: torch.device, world_size: int, load_start: tuple | None) -> dict:
    """Platform, software and device of this run (``load_average`` shows a shared machine)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cpu_count": os.cpu_count(), "device": device.type, "device_name": name,
            "world_size": world_size, "backend": dist.get_backend(), "threads_per_rank": torch.get_num_threads(),
            "load_average_start": list(load_start) if load_start else None,
            "load_average_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            match = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.MULTILINE)
        if match:
            return match.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def report(result: dict, args: argparse.Namespace) -> None:
    """Print the tables; write the JSON and the PNG when asked."""
    print(format_report(result))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json_path}")
    if args.png_path:
        plot(result, args.png_path)
        print(f"wrote {args.png_path}")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns right-aligned to their widest cell (the first left-aligned)."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    lines = []
    for row in [headers, *rows]:
        cells = [str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells))
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _mib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / MIB:.1f}"


def format_report(result: dict) -> str:
    m, model = result["machine"], result["model"]
    memory_label = "max alloc +MiB" if m["device"] == "cuda" else "peak RSS +MiB"
    headers = ["system", "median ms", "min ms", "max ms", "tokens/s", "exposed comm ms", "comm in flight ms",
               memory_label, "peak alloc +MiB", "state + peak MiB", "comm/Ψ (paper)", "loss step 1"]
    rows = [[name, _ms(s["median_s"]), _ms(s["min_s"]), _ms(s["max_s"]), f"{s['tokens_per_s']:.0f}",
             _ms(s["exposed_comm_s"]), _ms(s["comm_in_flight_s"]), _mib(s["peak_memory_bytes"]),
             _mib(s.get("step_peak_alloc_bytes")), _mib(s.get("state_plus_peak_bytes")),
             f"{s['comm_ratio']:.3f} ({s['paper_ratio']})", f"{s['losses'][0]:.6f}"]
            for name, s in result["systems"].items()]
    check = result["loss_check"]
    load = m.get("load_average_start")
    lines = [
        f"{model['name']}: Ψ = {model['psi']:,} parameters, {model['tokens_per_step']:,} tokens per step; "
        f"world size {m['world_size']} ({m['backend']}, {m['device_name']}, {m['threads_per_rank']} thread(s) per rank); "
        f"torch {m['torch']}" + (f"; load average {load[0]:.1f} at start" if load else ""),
        f"{result['settings']['steps']} timed steps after {result['settings']['warmup']} warm-up; "
        f"exposed comm from {result['settings']['profile_steps']} profiled steps, peak alloc from as many more "
        f"(profile_memory); peak RSS over the timed steps",
        "",
        format_table(headers, rows),
        "",
        f"losses: step 1 differs by at most {check['step1_max_abs_diff']:.2e} across systems; "
        f"step {check['last_step']} by {check['last_max_abs_diff']:.2e}",
    ]
    at_peak = {name: s["allocations_per_rank"][0].get("at_peak") for name, s in result["systems"].items()}
    if any(at_peak.values()):
        lines += ["", "at the highest allocation point of the profiled steps (rank 0), allocated by:"]
        for name, entries in at_peak.items():
            lines.append(f"  {name}: " + "; ".join(f"{e['ops']} {_mib(e['bytes'])} MiB" for e in entries[:4]))
    if result.get("simulate"):
        lines += ["", format_simulation(result)]
    return "\n".join(lines)


def format_simulation(result: dict) -> str:
    sim = result["simulate"]
    lines = []
    for name, cluster in sim["clusters"].items():
        rows = []
        for system, s in result["systems"].items():
            p = s.get("simulate", {}).get(name)
            if p is None:
                continue
            mem = p["model_state_bytes_per_rank"]
            rows.append([system, _ms(p["step_s"]), _ms(p["compute_s"]), _ms(p["comm_s"]), _ms(p["exposed_comm_s"]),
                         "-" if mem is None else f"{mem['with_overheads'] / MIB:.2f} ({mem['formula'] / MIB:.2f})"])
        lines += [f"simulated on {name}: {cluster['description']}, world size {cluster['world_size']}",
                  format_table(["system", "step ms", "compute ms", "comm ms", "exposed comm ms",
                                "model states MiB/rank (formula)"], rows)]
        lines += [f"  assumption: {a}" for a in cluster["assumptions"]]
        lines += ["  memory: zerograph.plan at this world size, fp32 parameters and gradients, AdamW fp32 states, "
                  "with padding, in-flight gathers and the gradient bucket; activations not included", ""]
    for system, check in (sim.get("self_check") or {}).items():
        lines.append(f"self-check {system}: simulated '{LOCAL_CLUSTER}' {check['predicted_s'] * 1e3:.1f} ms vs the profiled "
                     f"step it was built from {check['measured_profiled_step_s'] * 1e3:.1f} ms "
                     f"({check['relative_error'] * 100:+.1f}%); vs the timed median {check['measured_median_s'] * 1e3:.1f} ms "
                     f"({check['relative_error_vs_median'] * 100:+.1f}%)")
    if sim.get("self_check"):
        lines.append("  (op times come from the profiled step; what is modelled is communication: alpha-beta "
                     "collectives on one stream and the waits they cause)")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Bar chart: per system, median step time split into exposed communication and the rest,
    with min / max step time as error bars (matplotlib, no display needed)."""
    from matplotlib.figure import Figure

    names = list(result["systems"])
    systems = [result["systems"][n] for n in names]
    median = [s["median_s"] * 1e3 for s in systems]
    exposed = [min(s["exposed_comm_s"] or 0.0, s["median_s"]) * 1e3 for s in systems]
    rest = [m - e for m, e in zip(median, exposed)]
    low = [m - s["min_s"] * 1e3 for m, s in zip(median, systems)]
    high = [s["max_s"] * 1e3 - m for m, s in zip(median, systems)]
    fig = Figure(figsize=(max(6.0, 1.2 * len(names)), 4.5))
    ax = fig.add_subplot()
    x = range(len(names))
    ax.bar(x, rest, color="#4c72b0", label="compute and other (median − exposed)")
    ax.bar(x, exposed, bottom=rest, color="#dd8452", label="exposed communication")
    ax.errorbar(x, median, yerr=[low, high], fmt="none", ecolor="black", capsize=4, label="min / max step")
    ax.set_xticks(list(x), names, rotation=30, ha="right")
    ax.set_ylabel("step time (ms)")
    m = result["machine"]
    load = m.get("load_average_start")
    title = f"{result['model']['name']}, world size {m['world_size']} ({m['backend']}, {m['device_name']})"
    if load:  # a shared machine's numbers vary; say how busy it was
        title += f", load average {load[0]:.1f} on {m['cpu_count']} CPUs"
    ax.set_title(title, fontsize=9, pad=28)
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
