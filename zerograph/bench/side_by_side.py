"""Peak memory of one rank, side by side: zerograph stage 3, FSDP2 eager and FSDP2 + ``torch.compile``.

Each system runs as rank 0 of a fake world of N (``zerograph.fake_world``: PyTorch's ``fake``
process group, collectives move no data, every tensor this rank holds is real and of its real
size) on the same meta-built model and micro-batch: sharded, this rank's shards initialised,
AdamW built, two training steps run (the second holds the optimizer's moments). Each system runs in
a fresh Python process with ``MALLOC_MMAP_THRESHOLD_=65536``, so the resident set follows the live
tensors (docs/memory.md, section "Side by side with FSDP2", has the method and the baseline).

Measured per system (``measure``), bytes: ``peak_rss_growth`` (peak resident set over the build,
init and two steps, less the baseline), ``held_after_steps`` (resident set after the second step,
less the baseline), ``state_bytes`` (parameters, ``.grad`` and optimizer state this rank holds,
from the tensors: ``zerograph.bench.held_bytes``); beside them ``Plan.step_peak_bytes``.

Models (``MODELS``): the GPT of ``zerograph.models.gpt`` (blocks in an ``nn.ModuleList``) and the
torchtitan-style Llama of ``zerograph.models.llama`` (layers in an ``nn.ModuleDict``); FSDP2 wraps
each block with ``fully_shard``, then the root, on a 1-D ``DeviceMesh`` over the fake group.

Entry points: ``side_by_side`` (one subprocess per model and system, returns the JSON-able
result), ``format_table``; ``python -m zerograph.bench.side_by_side --worker SPEC`` is the
subprocess. ``zerograph memory`` (``side_by_side_cli``, or ``examples/memory_side_by_side.py``) is the
command line.

Source: ``torch.distributed.fsdp.fully_shard`` (FSDP2); ``torch.testing._internal.distributed.fake_pg``;
glibc ``mallopt(M_MMAP_THRESHOLD)``; ZeRO (arXiv 1910.02054) section 5 for the model states.
"""
from __future__ import annotations

import ctypes
import dataclasses
import datetime
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from torch import nn

from .real_models import REAL_MODELS, RealModel

SYSTEMS = ("zerograph-s3", "fsdp2", "fsdp2-compile")
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
RESULT_PREFIX = "SIDE_BY_SIDE_RESULT "
MIB = 2**20


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model and this rank's micro-batch: ``family`` ``"gpt"``, ``"llama"`` or a real model of
    ``REAL_MODELS`` (``"hf-gpt2"``, ``"hf-llama"``, ``"titan-llama"``), width ``dim``, ``layers``
    blocks, ``heads``, ``vocab`` tokens, ``batch`` x ``seq`` tokens per rank."""

    family: str
    dim: int
    layers: int
    heads: int
    vocab: int = 256
    batch: int = 1
    seq: int = 128

    @property
    def label(self) -> str:
        return f"{self.family} {self.dim}x{self.layers}, {self.batch}x{self.seq} tokens"

    @property
    def real(self) -> RealModel | None:
        """The family's ``RealModel``; ``None`` for zerograph's own GPT and Llama."""
        return REAL_MODELS.get(self.family)

    def config(self) -> Any:
        if self.family == "gpt":
            from ..models.gpt import GPTConfig
            return GPTConfig(vocab_size=self.vocab, block_size=self.seq, n_layer=self.layers, n_head=self.heads,
                             n_embd=self.dim)
        if self.family == "llama":
            from ..models.llama import LlamaConfig
            return LlamaConfig(dim=self.dim, n_layers=self.layers, n_heads=self.heads, vocab_size=self.vocab,
                               max_seq_len=self.seq)
        raise ValueError(f"unknown model family {self.family!r}: gpt, llama or one of {', '.join(REAL_MODELS)}")

    def build(self) -> nn.Module:
        """The model under ``torch.device("meta")`` (no storage)."""
        with torch.device("meta"):
            if self.real is not None:
                return self.real.build(self.dim, self.layers, self.heads, self.vocab, self.seq)
            if self.family == "gpt":
                from ..models.gpt import GPT
                return GPT(self.config())
            from ..models.llama import Llama
            return Llama(self.config())

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The modules FSDP2 wraps one by one (zerograph finds the same ones as its units)."""
        if self.real is not None:
            return self.real.blocks(model)
        return list(model.blocks) if self.family == "gpt" else list(model.layers.values())

    def loss(self, model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The step's mean loss: ``model(tokens, targets)``, or a real model's loss, computed outside it."""
        return model(tokens, targets) if self.real is None else self.real.loss(model, tokens, targets)

    def init_sharded(self, model: nn.Module) -> None:
        """Initialise the meta-built ``model`` once sharded: zerograph's through ``init_weights``
        (one module at a time), FSDP2's after ``to_empty``."""
        import zerograph

        from ..runtime.state import is_compiled

        if is_compiled(model):
            fn = (model.init_passes() if self.family == "gpt" else model.init_module if self.real is None
                  else self.real.init_module(model))
            zerograph.init_weights(model, fn)
        elif self.real is not None:
            self.real.init(model)
        elif self.family == "gpt":
            for fn in model.init_passes():
                model.apply(fn)
        else:
            model.init_weights(buffer_device=torch.device("cpu"))

    def inputs(self, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, targets), each (batch, seq) int64."""
        g = torch.Generator().manual_seed(1)
        x = torch.randint(self.vocab, (self.batch, self.seq + 1), generator=g)
        return x[:, :-1].contiguous().to(device), x[:, 1:].contiguous().to(device)

    def tiny(self) -> ModelSpec:
        """A small model of the same family, stepped first so imports stay out of the figures."""
        return dataclasses.replace(self, dim=64, layers=2, heads=4, batch=1, seq=16)


MODELS = {  # the sizes of docs/benchmarks.md's memory table, and the real models at the Llama's size with its batch doubled
    "gpt": ModelSpec("gpt", dim=1024, layers=16, heads=16, batch=2, seq=256),
    "llama": ModelSpec("llama", dim=1024, layers=8, heads=16, batch=1, seq=128),
    **{name: ModelSpec(name, dim=1024, layers=8, heads=16, batch=2, seq=128) for name in REAL_MODELS},
}


# ----------------------------------------------------------------------------- one system, in process


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


def _settle() -> int:
    """Collect garbage, give freed heap back to the system; returns the resident set, bytes."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    return _status_bytes("VmRSS")


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _wrap(system: str, spec: ModelSpec, model: nn.Module) -> nn.Module:
    """Shard the meta-built ``model`` by ``system`` and initialise this rank's shards on the CPU."""
    torch.manual_seed(0)
    if system == "zerograph-s3":
        import zerograph

        model = zerograph.compile(model, stage=3, device="cpu")
        spec.init_sharded(model)
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for block in spec.blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    spec.init_sharded(model)
    if system == "fsdp2-compile":
        model = torch.compile(model)
    return model


def _steps(model: nn.Module, spec: ModelSpec, steps: int) -> tuple[torch.optim.Optimizer, list[float]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = spec.inputs()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        loss = spec.loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        del loss
    return opt, times


def measure(system: str, spec: ModelSpec, world_size: int, *, steps: int = 2, prime: bool = True) -> dict:
    """Peak RSS growth of rank 0 of a fake world of ``world_size`` running ``system`` on ``spec``.

    Initialises (and destroys) the default process group: none may be initialised. Raises
    ``ValueError`` for an unknown system. See the module docstring for what is measured.
    """
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; known: {SYSTEMS}")
    import zerograph

    from .memory import held_bytes

    with zerograph.fake_world(world_size, rank=0):
        if prime:
            model = _wrap(system, spec.tiny(), spec.tiny().build())
            _steps(model, spec.tiny(), 1)
            del model
            if system == "fsdp2-compile":
                torch._dynamo.reset()  # the measured model compiles afresh either way; drop the tiny one's code
        baseline = _settle()
        method = "VmHWM" if _reset_peak() else "unavailable"
        start = time.perf_counter()
        model = _wrap(system, spec, spec.build())
        init_peak = _status_bytes("VmHWM") - baseline
        init_s = time.perf_counter() - start
        opt, step_s = _steps(model, spec, steps)
        peak = _status_bytes("VmHWM") - baseline
        held = _status_bytes("VmRSS") - baseline
        state = held_bytes(model, opt)
        extra = {}
        if system == "zerograph-s3":
            st = zerograph.stats(model, opt)
            extra = {"zerograph_stats": {"resident_bytes": dict(st.resident_bytes),
                                         "transient_bytes": dict(st.transient_bytes),
                                         "saved_activation_bytes": st.saved_activation_bytes},
                     "templated_units": templated_units(model)}
        del model, opt
    return {"system": system, "model": dataclasses.asdict(spec), "world_size": world_size, "steps": steps,
            "rss_method": method, "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
            "peak_rss_growth_bytes": peak, "init_peak_rss_growth_bytes": init_peak,
            "held_after_steps_bytes": held, "state_bytes": state, "init_s": init_s, "step_s": step_s,
            "error": None, **extra}


def templated_units(model: nn.Module) -> dict[str, int]:
    """How many of a compiled model's units ran their unit template in its forward graphs: calls of
    ``zerograph::unit_forward`` in the final forward graphs (``templated``) against the units
    other than the root (``units``); the others ran their body inline, traced into the model's graph."""
    from ..runtime.state import state_of, units_of

    forward_op = torch.ops.zerograph.unit_forward.default
    graphs = [record["forward"].graph for record in state_of(model).captured.graphs if "forward" in record]
    calls = sum(1 for graph in graphs for node in graph.nodes if node.target is forward_op)
    return {"templated": calls, "units": len(units_of(model)) - 1}


def step_time_summary(step_s: list[float], warmup: int) -> dict[str, float] | None:
    """Median, min and max seconds of the steps after the first ``warmup``; ``None`` if none are left."""
    timed = step_s[warmup:]
    if not timed:
        return None
    return {"median_s": statistics.median(timed), "min_s": min(timed), "max_s": max(timed), "steps": len(timed)}


# ----------------------------------------------------------------------------- the side-by-side run


def predicted(spec: ModelSpec, world_size: int) -> dict:
    """``zerograph.plan``'s stage-3 prediction for ``spec`` in fp32 (this bench's dtypes). Where the
    plan cannot trace the model's forward on fake tensors, it is made without activations and a
    note says so."""
    import zerograph

    from ..errors import ConfigError

    x, y = spec.inputs("meta")
    example = (x, y) if spec.real is None else (x,)  # a real model's forward takes the tokens; the loss is outside
    options = {"param_dtype": torch.float32, "master_dtype": torch.float32,
               "prefetch_depth": zerograph.Config().schedule.prefetch_depth}
    notes = []
    try:
        p = zerograph.plan(spec.build(), 3, world_size, example_inputs=example, **options)
    except ConfigError as exc:
        p = zerograph.plan(spec.build(), 3, world_size, **options)
        notes.append(f"activations left out of the plan: {exc}")
    return {"psi": p.psi, "model_states_bytes": p.bytes_per_rank["total"] + p.padding_bytes,
            "step_peak_bytes": p.step_peak_bytes, "step_peak_breakdown": dict(p.step_peak_breakdown),
            "notes": notes + list(p.peak_notes)}


def run_in_subprocess(system: str, spec: ModelSpec, world_size: int, steps: int, timeout_s: float) -> dict:
    """``measure`` in a fresh interpreter with ``MALLOC_ENV`` set; an error becomes the result's
    ``error`` (the last lines of its stderr) instead of numbers."""
    env = {**os.environ, **MALLOC_ENV}
    job = json.dumps({"system": system, "spec": dataclasses.asdict(spec), "world_size": world_size, "steps": steps})
    try:
        done = subprocess.run([sys.executable, "-m", "zerograph.bench.side_by_side", "--worker", job], env=env,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return _failed(system, spec, world_size, f"timed out after {timeout_s:.0f} s")
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    tail = "\n".join(done.stderr.strip().splitlines()[-6:])
    return _failed(system, spec, world_size, f"exit status {done.returncode}: {tail}")


def _failed(system: str, spec: ModelSpec, world_size: int, error: str) -> dict:
    return {"system": system, "model": dataclasses.asdict(spec), "world_size": world_size, "error": error}


def side_by_side(specs: dict[str, ModelSpec], world_size: int, systems=SYSTEMS, *, steps: int = 2,
                 warmup: int = 1, timeout_s: float = 900.0, in_process: bool = False, log=None) -> dict:
    """Every system on every model; returns ``{"machine", "command", "rows": [...]}``, one row per
    model with the plan's prediction and each system's measurement. ``warmup``: the first steps
    left out of the step times (the table's; every step's time is in the result). ``in_process=True``
    measures in this process instead (no fresh interpreter, no allocator setting: for tests)."""
    source = {"commit": _commit(), "uncommitted": _git("status", "--porcelain", "--untracked-files=no").splitlines()}
    rows = []  # the commit is read before the run: code committed during it is not what ran
    for name, spec in specs.items():
        row = {"model": name, "spec": dataclasses.asdict(spec), "label": spec.label,
               "plan": predicted(spec, world_size), "systems": {}}
        for system in systems:
            if log:
                log(f"{name}: {system} ...")
            if in_process:
                result = measure(system, spec, world_size, steps=steps, prime=False)
            else:
                result = run_in_subprocess(system, spec, world_size, steps, timeout_s)
            row["systems"][system] = result
        rows.append(row)
    return {"world_size": world_size, "steps": steps, "warmup": warmup, "systems": list(systems), "rows": rows,
            "machine": machine(), "date": datetime.date.today().isoformat(), **source}


def machine() -> str:
    cpus = os.cpu_count()
    with open("/proc/meminfo") as f:
        total = int(f.readline().split()[1]) * 1024
    return f"{platform.machine()} Linux, {cpus} CPUs, {total / 2**30:.0f} GiB, torch {torch.__version__}"


def _commit() -> str | None:
    return _git("rev-parse", "--short", "HEAD").strip() or None


def _git(*args: str) -> str:
    """``git args`` in this package's checkout; "" outside one."""
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, cwd=os.path.dirname(__file__), timeout=10)
        return out.stdout if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def format_table(result: dict) -> str:
    """A markdown table: per model, each system's peak RSS growth (MiB), the plan's prediction
    and its error against zerograph's measurement, and zerograph's ratio to FSDP2 eager."""
    systems = result["systems"]
    head = ["model", "Ψ", *systems, "plan (s3)", "plan / measured s3", "s3 / fsdp2"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 1 + "---:|" * (len(head) - 1)]
    notes = []
    for row in result["rows"]:
        cells = [row["label"], f"{row['plan']['psi']:,}"]
        peaks = {}
        for system in systems:
            r = row["systems"].get(system, {})
            if r.get("error"):
                cells.append("failed")
                notes.append(f"{row['model']} / {system}: {r['error'].splitlines()[-1] if r['error'] else ''}")
            else:
                peaks[system] = r["peak_rss_growth_bytes"]
                cells.append(f"{peaks[system] / MIB:,.0f} MiB")
        plan = row["plan"]["step_peak_bytes"]
        cells.append(f"{plan / MIB:,.0f} MiB")
        s3, fsdp = peaks.get("zerograph-s3"), peaks.get("fsdp2")
        cells.append(f"{plan / s3:.2f}" if s3 else "-")
        cells.append(f"{s3 / fsdp:.2f}x" if s3 and fsdp else "-")
        lines.append("| " + " | ".join(cells) + " |")
        notes += [f"{row['model']} plan: {n}" for n in row["plan"]["notes"]]
    lines.append("")
    lines.append(f"Peak RSS growth of rank 0 of a fake world of {result['world_size']}, {result['steps']} AdamW steps, "
                 f"fp32, MALLOC_MMAP_THRESHOLD_=65536; {result['machine']}; {result['date']}, commit {result['commit']}"
                 + (f" with {len(result['uncommitted'])} uncommitted file(s)" if result.get("uncommitted") else ""))
    lines += notes
    return "\n".join(lines + ["", *format_time_table(result)])


def format_time_table(result: dict) -> list[str]:
    """Markdown lines: per model, each system's step time, median (min-max) in ms over the steps
    after the first ``result["warmup"]``, zerograph's ratio to FSDP2 eager and how many of its units
    ran their template (``templated_units``)."""
    systems, warmup = result["systems"], result.get("warmup", 0)
    head = ["model", *(f"{s} step ms" for s in systems), "s3 / fsdp2", "s3 templated units"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for row in result["rows"]:
        cells, medians = [row["label"]], {}
        for system in systems:
            r = row["systems"].get(system, {})
            summary = None if r.get("error") else step_time_summary(r["step_s"], warmup)
            if summary is None:
                cells.append("failed" if r.get("error") else "-")
                continue
            medians[system] = summary["median_s"]
            cells.append(f"{summary['median_s'] * 1e3:,.0f} ({summary['min_s'] * 1e3:,.0f}-{summary['max_s'] * 1e3:,.0f})")
        s3, fsdp = medians.get("zerograph-s3"), medians.get("fsdp2")
        cells.append(f"{s3 / fsdp:.2f}x" if s3 and fsdp else "-")
        templated = row["systems"].get("zerograph-s3", {}).get("templated_units")
        cells.append(f"{templated['templated']} / {templated['units']}" if templated else "-")
        lines.append("| " + " | ".join(cells) + " |")
    timed = max(0, result["steps"] - warmup)
    return lines + ["", f"Step time of the same runs: median (min-max) of steps {warmup + 1}-{result['steps']} "
                        f"({timed} steps) of each system's fresh process, ms."]


def _worker(job: str) -> None:
    args = json.loads(job)
    spec = ModelSpec(**args["spec"])
    try:
        result = measure(args["system"], spec, args["world_size"], steps=args["steps"])
    except Exception as exc:  # reported as the row's error, not as numbers
        import traceback
        traceback.print_exc()
        result = _failed(args["system"], spec, args["world_size"], f"{type(exc).__name__}: {exc}")
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        _worker(sys.argv[2])
    else:
        sys.exit("usage: python -m zerograph.bench.side_by_side --worker JSON (see examples/memory_side_by_side.py)")
