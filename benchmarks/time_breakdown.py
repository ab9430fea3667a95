"""Where the device time of one resident prefill batch goes, by stage of the layer.

Runs one packed batch through the resident forward (every weight on one device,
``moejax.model.forward`` jitted as ``ResidentBackend`` jits it) under
``jax.profiler.trace`` and attributes every device-side op of the trace to one stage:

    attention, experts, route, permute, norm, lm_head, embed, other

The stages are the ``jax.named_scope`` s of the layer driver (``moejax.layers``,
``moejax.moe``, ``moejax.model``): XLA keeps them in each instruction's
``metadata={op_name="jit(forward)/while/body/.../attention/dot_general"}``. The
compiled module's text maps each instruction name to its op_name; a trace event names
its instruction (arg ``hlo_op`` on CPU thunks and GPU kernels; else the event name,
GPU kernel names being fusion names with '.' -> '_'; else the ``long_name`` /
``tf_op`` args). The innermost scope of the op_name wins (a norm inside attention is
a norm). A fusion without metadata takes the most common scope of its fused
instructions; an instruction with no scope (loop bookkeeping, layer slicing, XLA's
copies) and a device event of no instruction (a memcpy) count as ``other``.

Times: the device wall is first op start to last op end of the traced forward; busy
is the union of its op intervals. Where ops overlap (CPU runtime threads, GPU
streams), each instant is split equally between the stages running then, so the
stage times sum to busy <= wall. Printed: each stage's share of wall and of busy.

On a GPU, CUDA-graph command buffers hide the kernels' HLO names from the profiler,
so they are switched off here (``--command-buffers`` keeps them); the unattributed
share is printed so that a reader can check. Model and dtype as
``benchmarks/backends.py``'s ``model_shape`` (GPU: Qwen3-30B-A3B shape, 8 layers,
bf16). Random weights are made on the device (``benchmarks/full_model.py``).

    python -m benchmarks.time_breakdown [--quick] [--json PATH] [--tokens T] [--block B]
        [--layers L] [--dtype bfloat16|float32] [--repeats N] [--peak-tflops X]
        [--command-buffers] [--trace-dir DIR]

JSON keys (flat): ``breakdown_<stage>_fraction`` (share of the device wall),
``breakdown_<stage>_busy_fraction``, ``breakdown_wall_s``, ``breakdown_busy_s``,
``breakdown_tokens``, ``breakdown_tokens_per_s``, ``breakdown_mfu``,
``breakdown_unattributed_fraction`` (share of busy in ``other`` events of no
instruction), ``platform``, ``device_kind``, ``dtype``, ``layers``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
from typing import Any, Mapping, Sequence

from benchmarks.lib import models, trace
from benchmarks.lib.cli import bench_parser, parse_args
from benchmarks.lib.meta import finish_run, platform_figures
from benchmarks.lib.timing import device_peak, median_seconds

SCOPES = ("attention", "experts", "route", "permute", "norm", "lm_head", "embed")
CATEGORIES = SCOPES + ("other",)
COMMAND_BUFFER_OFF = "--xla_gpu_enable_command_buffer="
# A scope may appear wrapped by a transformation: 'jvp(attention)', 'transpose(jvp(norm))'.
_COMPONENT = re.compile(r"^(?:(?:jvp|transpose|vmap|remat|checkpoint)\()*([A-Za-z_]+)\)*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
# Control flow wraps other ops (a CPU while thunk's event encloses its body's): dropped.
_CONTROL = re.compile(r"\s(while|conditional|call)\(")
CONTROL = "control"


# ==================================================================== HLO metadata
def scope_of(op_name: str | None) -> str | None:
    """The innermost stage scope in an op_name path, or None."""
    for component in reversed((op_name or "").split("/")):
        match = _COMPONENT.match(component)
        if match and match.group(1) in SCOPES:
            return match.group(1)
    return None


@dataclasses.dataclass
class Instruction:
    name: str
    computation: str
    op_name: str | None
    calls: str | None
    control: bool = False


def parse_instructions(hlo_text: str) -> dict[str, Instruction]:
    """Every instruction of a compiled module's text: name -> its computation, op_name
    metadata and the computation it calls (a fusion's)."""
    out: dict[str, Instruction] = {}
    computation = ""
    for line in hlo_text.splitlines():
        match = _INSTRUCTION.match(line)
        if match:
            rest = match.group(2)
            op_name, calls = _OP_NAME.search(rest), _CALLS.search(rest)
            out[match.group(1)] = Instruction(
                name=match.group(1), computation=computation,
                op_name=op_name.group(1) if op_name else None,
                calls=calls.group(1) if calls else None,
                control=bool(_CONTROL.search(rest)))
            continue
        header = _COMPUTATION.match(line)
        if header:
            computation = header.group(1)
    return out


def instruction_categories(hlo_text: str) -> dict[str, str]:
    """Instruction name (as printed, and with '.'/'-' -> '_' as GPU kernels are named)
    -> stage, for every instruction of the module (module docstring); control flow
    (while, conditional, call) -> :data:`CONTROL`."""
    instructions = parse_instructions(hlo_text)
    by_computation: dict[str, list[str]] = collections.defaultdict(list)
    for ins in instructions.values():
        scope = scope_of(ins.op_name)
        if scope:
            by_computation[ins.computation].append(scope)
    table: dict[str, str] = {}
    for ins in instructions.values():
        scope = scope_of(ins.op_name)
        if scope is None and ins.calls and by_computation.get(ins.calls):
            scope = collections.Counter(by_computation[ins.calls]).most_common(1)[0][0]
        category = CONTROL if ins.control else scope or "other"
        table[ins.name] = category
        table.setdefault(kernel_key(ins.name), category)
    return table


def kernel_key(name: str) -> str:
    """A name as GPU kernels spell it: '.' and '-' -> '_'."""
    return name.replace(".", "_").replace("-", "_")


def module_name(hlo_text: str) -> str | None:
    """'jit_forward' from the module's first line 'HloModule jit_forward, ...'."""
    match = re.search(r"HloModule\s+([\w.\-]+)", hlo_text)
    return match.group(1) if match else None


# ==================================================================== trace events
@dataclasses.dataclass(frozen=True)
class OpEvent:
    """One device-side op of the trace: lane, [start, end) seconds, its stage, and
    whether it named an instruction of the module."""

    lane: Any
    start: float
    end: float
    category: str
    attributed: bool
    name: str = ""


def event_instruction(ev: Mapping[str, Any], table: Mapping[str, str]) -> str | None:
    """The module instruction an event ran, if any can be read from it."""
    args = ev.get("args", {}) or {}
    candidates = [args.get("hlo_op"), ev.get("name")]
    long_name = str(args.get("long_name", ""))
    if long_name:
        candidates.append(long_name.split("=")[0].strip().lstrip("%").split(" ")[0])
    for name in candidates:
        if not name:
            continue
        name = str(name)
        for key in (name, kernel_key(name)):
            if key in table:
                return key
    return None


def event_category(ev: Mapping[str, Any], table: Mapping[str, str]) -> tuple[str, bool]:
    """(stage, attributed) of one event: through its instruction, else a scope in its
    ``tf_op`` / ``long_name`` args, else ('other', False)."""
    instruction = event_instruction(ev, table)
    if instruction is not None:
        return table[instruction], True
    args = ev.get("args", {}) or {}
    for key in ("tf_op", "long_name"):
        text = str(args.get(key, ""))
        found = _OP_NAME.search(text)
        scope = scope_of(found.group(1) if found else text)
        if scope:
            return scope, True
    return "other", False


def is_op_event(ev: Mapping[str, Any], lane: Any, device_lanes: bool,
                module: str | None) -> bool:
    """A complete event of device work of ``module``: any event on a device plane (GPU,
    TPU), an event naming an HLO op on CPU (the runtime's thunks); not a marker."""
    if ev.get("ph") != "X" or "dur" not in ev or lane is None:
        return False
    args = ev.get("args", {}) or {}
    if module and args.get("hlo_module") not in (None, module):
        return False
    return device_lanes or "hlo_op" in args


def op_events(chrome_trace: Mapping[str, Any] | Sequence[Mapping[str, Any]],
              table: Mapping[str, str], module: str | None) -> list[OpEvent]:
    """The device-side op events of a Chrome trace (lanes as :func:`trace.device_work`)."""
    device_lanes, work = trace.device_work(chrome_trace)
    out = []
    for lane, ev in work:
        if not is_op_event(ev, lane, device_lanes, module):
            continue
        start = float(ev["ts"]) * 1e-6
        category, attributed = event_category(ev, table)
        if category == CONTROL:
            continue
        name = event_instruction(ev, table) or str(ev.get("name", ""))
        out.append(OpEvent(lane=lane, start=start, end=start + float(ev["dur"]) * 1e-6,
                           category=category, attributed=attributed, name=name))
    return out


# ==================================================================== attribution
@dataclasses.dataclass
class Breakdown:
    """Seconds per stage (summing to busy_s), the device wall and busy time, and the
    busy seconds in events of no instruction."""

    wall_s: float
    busy_s: float
    seconds: dict[str, float]
    unattributed_s: float

    def wall_fraction(self, category: str) -> float:
        return self.seconds.get(category, 0.0) / self.wall_s if self.wall_s else 0.0

    def busy_fraction(self, category: str) -> float:
        return self.seconds.get(category, 0.0) / self.busy_s if self.busy_s else 0.0


def attribute(events: Sequence[OpEvent]) -> Breakdown:
    """The stage breakdown of a forward's op events (module docstring)."""
    if not events:
        return Breakdown(wall_s=0.0, busy_s=0.0, seconds={}, unattributed_s=0.0)
    wall = max(e.end for e in events) - min(e.start for e in events)
    busy = trace.length(trace.merge((e.start, e.end) for e in events))
    labelled = [(e.start, e.end, e.category if e.attributed else "other:unattributed")
                for e in events]
    split = trace.split_time(labelled)
    unattributed = split.pop("other:unattributed", 0.0)
    seconds = {c: split.get(c, 0.0) for c in CATEGORIES}
    seconds["other"] += unattributed
    return Breakdown(wall_s=wall, busy_s=busy, seconds=seconds, unattributed_s=unattributed)


def top_other(events: Sequence[OpEvent], op_names: Mapping[str, str | None],
              count: int = 6) -> list[tuple[str, float]]:
    """The ``other`` events' largest (instruction: op_name tail, summed seconds)."""
    totals: dict[str, float] = collections.defaultdict(float)
    for e in events:
        if e.category == "other":
            tail = "/".join((op_names.get(e.name) or "").split("/")[-2:])
            totals[f"{trace.base_name(e.name)} ({tail or 'no op_name'})"] += e.end - e.start
    return sorted(totals.items(), key=lambda kv: -kv[1])[:count]


def breakdown_figures(result: Breakdown) -> dict[str, float]:
    """The flat JSON figures of a breakdown (shares of wall and of busy)."""
    out: dict[str, float] = {"breakdown_wall_s": result.wall_s,
                             "breakdown_busy_s": result.busy_s,
                             "breakdown_unattributed_fraction":
                                 result.unattributed_s / result.busy_s if result.busy_s else 0.0}
    for category in CATEGORIES:
        out[f"breakdown_{category}_fraction"] = result.wall_fraction(category)
        out[f"breakdown_{category}_busy_fraction"] = result.busy_fraction(category)
    return out


def print_breakdown(result: Breakdown) -> None:
    print(f"device wall {result.wall_s * 1e3:.2f} ms, busy {result.busy_s * 1e3:.2f} ms "
          f"({100 * result.busy_s / max(result.wall_s, 1e-30):.1f}% of wall)")
    print(f"{'stage':<11}{'ms':>10}{'% wall':>9}{'% busy':>9}")
    for category in CATEGORIES:
        print(f"{category:<11}{result.seconds[category] * 1e3:>10.3f}"
              f"{100 * result.wall_fraction(category):>9.1f}"
              f"{100 * result.busy_fraction(category):>9.1f}")
    print(f"(of 'other', {result.unattributed_s * 1e3:.3f} ms ran in events naming no "
          f"instruction of the module)")


# ==================================================================== the run
def compile_forward(params: Any, batch: Any, cfg: Any, opts: Any) -> Any:
    """The resident forward, lowered and compiled for this batch (the executable that is
    run and traced, so its text names the trace's instructions)."""
    import jax

    from moejax import model as model_lib

    jitted = jax.jit(model_lib.forward, static_argnames=("cfg", "opts"))
    return jitted.lower(params, batch, cfg=cfg, opts=opts).compile()


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__, quick_help="tiny model, seconds on CPU", repeats=3,
                          repeats_help="timed runs (median)")
    parser.add_argument("--tokens", type=int, help="tokens in the batch (power of two; "
                        "default 32768 GPU, 1024 CPU, 128 quick)")
    parser.add_argument("--block", type=int, help="attention block = longest sequence")
    parser.add_argument("--layers", type=int, help="decoder layers (GPU default 8)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"))
    parser.add_argument("--peak-tflops", type=float, help="device peak used for MFU")
    parser.add_argument("--command-buffers", action="store_true",
                        help="keep XLA's GPU command buffers (hides kernel names)")
    parser.add_argument("--trace-dir", help="keep the trace here (default: a temporary dir)")
    return parser


def command_buffers_off(keep_command_buffers: bool) -> None:
    """Before JAX starts: XLA's GPU command buffers off unless kept."""
    flags = os.environ.get("XLA_FLAGS", "")
    if not keep_command_buffers and "xla_gpu_enable_command_buffer" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {COMMAND_BUFFER_OFF}".strip()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(build_parser(), argv, gpu_overlap_flags=True)
    command_buffers_off(args.command_buffers)
    import jax

    cfg, dtype = models.model_shape(args)
    block, tokens = models.workload_shape(args.quick, args.block, args.tokens, gpu_tokens=32768,
                                          tokens_flag="--tokens")
    host = models.make_workload(cfg, 1, block, tokens)[0]
    peak, peak_source = device_peak(args.peak_tflops, dtype)
    print(f"time breakdown on {jax.default_backend()} ({jax.devices()[0].device_kind}): "
          f"Qwen3-MoE d={cfg.hidden_size} L={cfg.num_layers} E={cfg.num_experts} "
          f"k={cfg.num_experts_per_tok} f={cfg.moe_intermediate_size} V={cfg.vocab_size}, "
          f"{dtype}; one batch of {tokens} tokens (block {block}), {host.real_tokens} real",
          flush=True)
    params = models.device_params(cfg, dtype, jax.devices()[0])
    batch = jax.device_put(host.batch, jax.devices()[0])
    compiled = compile_forward(params, batch, cfg, host.options)
    hlo = compiled.as_text()
    wall = median_seconds(lambda: jax.block_until_ready(compiled(params, batch)), args.repeats,
                          label="forward")
    flops = models.useful_flops(cfg, [host])
    with trace.profile(args.trace_dir) as captured:
        jax.block_until_ready(compiled(params, batch))
    events = op_events(captured.trace, instruction_categories(hlo), module_name(hlo))
    result = attribute(events)
    mfu = flops / (wall * peak * 1e12)
    print(f"timed: {wall * 1e3:.2f} ms per batch (median of {args.repeats}), "
          f"{host.real_tokens / wall:.0f} tokens/s, MFU {100 * mfu:.2f}% of {peak:.3g} "
          f"TFLOP/s ({peak_source})")
    print_breakdown(result)
    op_names = {name: ins.op_name for name, ins in parse_instructions(hlo).items()}
    print("largest 'other' ops (summed over lanes): " + ", ".join(
        f"{name} {seconds * 1e3:.3f} ms" for name, seconds in top_other(events, op_names)))
    figures: dict[str, Any] = {
        **platform_figures(), "dtype": dtype, "layers": cfg.num_layers, "breakdown_tokens": host.real_tokens,
        "breakdown_padded_tokens": tokens, "breakdown_tokens_per_s": host.real_tokens / wall,
        "breakdown_mfu": mfu, "breakdown_timed_wall_s": wall, "peak_tflops": peak,
        "command_buffers": bool(args.command_buffers), **breakdown_figures(result)}
    return finish_run(figures, args.json_path)


if __name__ == "__main__":
    main()
