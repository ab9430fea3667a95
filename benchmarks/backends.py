"""Every execution backend on one workload, read through an XLA profiler trace.

Builds one Qwen3-MoE with random weights, packs one set of random-token sequences
into batches of a single shape, and runs that same token set through each backend
(``resident``, ``offload``, ``async_ep``, ``hybrid``, ``sync_ep``, ``tp``). Per
backend: warm up (compiles the one shape), ``moejax.calibrate.calibrate`` (prints
Θ), time the whole workload (synchronized, median of ``--repeats``), then one more
pass under ``jax.profiler.trace``. The Chrome-trace JSON the profiler writes
(``plugins/profile/<run>/<host>.trace.json.gz``) is parsed into per-device lanes;
events are classified as *transfer* (collectives, host<->device copies), *compute*
(kernels / fused ops) or *other* (runtime, control flow, host), and

    exposed transfer = |∪ transfer intervals| − |∪ transfer ∩ ∪ compute|   (per lane)

i.e. the time a device moves data with no compute running. The fraction printed is
Σ_lanes exposed / (traced wall time × devices used). The transfer event names found
are printed so that a reader can check the classification.

Where it falls (``offload``, ``hybrid``): the program executions are read from the
trace (GPU: a device plane's "XLA Modules" line; CPU: the ops sharing one
``run_id``), and the streamed programs by name (``jit_streamed_embed``, ``_gather``,
``_layer``, ``_last``). Exposed transfer is split by the gaps between programs it
falls in: *step start* (before a step's first layer program: from the previous
step's last program or the trace's start, across the embedding and hybrid's first
gather), *between layers* (the device waiting between two layer programs of a step:
the host's per-layer synchronization) and *other* (the rest, e.g. inside a program).
Device idle = the time with no program running between programs. ``sync_lag``
(``--sync-lag``; ``offload_waiting`` / ``hybrid_waiting`` in ``--backends`` run the
same backend with ``sync_lag=0``) is how many layer programs the host dispatches
ahead of the one it waits for (moejax/backends/streamed.py).

MFU = useful model FLOPs (DESIGN.md: per sequence ``cfg.request_flops(len, 0,
scoring_positions=1, num_candidates=2)``; padding not counted) / (wall × peak ×
devices). Peak: ``--peak-tflops``, else a table keyed by the device kind (H100/H200
SXM: 989 TFLOP/s bf16 dense, 67 f32), else on CPU the measured rate of a large f32
matmul on one device. On CPU the forced host devices share the same cores (one
device already uses them all), so there the device factor is 1.

Model: on a GPU the Qwen3-30B-A3B shape (d=2048, 32/4 heads of 128, E=128, k=8,
f=768, V=151936) with ``--layers`` layers (default 8), bf16; on CPU a small
Qwen3-MoE (d=256, 4 layers, E=32, k=4, f=256, V=2048), f32; ``--quick``: a tiny one.
On CPU, when ``XLA_FLAGS`` is unset, 8 host devices are forced before JAX starts.

Θ and the batch size: a streamed backend hides its copies only when one batch's
compute covers them, i.e. when one batch is at least Θ of work; each backend's line
prints "one batch = x Θ". On a GPU, raise ``--batch-tokens`` until offload's x ≥ 1
before reading its ratio to resident (a Qwen3-30B-A3B layer of experts is ~1.2 GB
in bf16: ~25 ms over PCIe, so tens of thousands of tokens per batch).

What the CPU trace can show: the mechanics only. CPU collectives are synchronous
(each device's thread waits in the rendezvous), host->device copies run on the
Python thread, and there are no separate copy or communication streams, so
transfers on CPU are (almost) always exposed. Whether transfers hide under compute
is a GPU question: run this there and record the figures in docs/PERF.md. On CPU
the multi-device backends are synchronized after every step: with two steps of a
collective program in flight, XLA:CPU was seen to deadlock in a rendezvous (8 host
devices on 2 cores) and abort after its 40 s timeout.

    python benchmarks/backends.py [--quick] [--json PATH] [--backends resident,offload,...]
        [--devices G] [--window W] [--sync-lag K] [--layers L] [--steps K] [--repeats N]
        [--block B] [--batch-tokens T] [--peak-tflops X] [--dtype bfloat16|float32]
        [--sync-steps] [--trace-dir DIR]

JSON keys (flat), per backend B: ``B_tokens_per_s``, ``B_tokens_per_s_per_device``,
``B_mfu``, ``B_exposed_transfer_fraction``, ``B_over_resident``,
``B_over_best_baseline``, ``B_expert_bytes_per_device``, ``B_expert_saving``,
``B_expected_expert_saving``, ``B_peak_temp_bytes``, ``B_theta_flops``,
``B_batch_over_theta``, ``B_devices``, ``B_wall_s``; for the streamed backends also
``B_sync_lag``, ``B_exposed_first_layer_fraction`` (step start),
``B_exposed_between_layers_fraction``, ``B_exposed_other_fraction`` (the three add up
to ``B_exposed_transfer_fraction``), ``B_device_idle_fraction``,
``B_idle_between_layers_fraction``; ``offload_lagged_over_waiting`` /
``hybrid_lagged_over_waiting`` (tokens/s, when both entries ran); and ``platform``,
``device_kind``, ``peak_tflops``, ``peak_source``, ``dtype``, ``devices``,
``tokens``, ``padded_tokens``, ``useful_flops``, ``skipped`` (backend -> reason).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import glob
import gzip
import json
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.figures import write_json  # noqa: E402

HOST_DEVICES = 8
# Before JAX starts: the flag only changes the CPU platform's device count (a GPU
# run ignores it), so it is set whenever the user gave no XLA_FLAGS of their own.
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={HOST_DEVICES}")

import moejax  # noqa: E402

if __name__ == "__main__":  # run as the benchmark: the GPU overlap flags, before JAX starts
    moejax.configure_xla()

import jax  # noqa: E402

from moejax.backends import BACKENDS, make_backend  # noqa: E402
from moejax.backends.base import BackendError, padded_step, plan_steps  # noqa: E402
from moejax.config import ModelConfig  # noqa: E402
from moejax.ops import PrefillOp  # noqa: E402
from moejax.packing import BucketPolicy, HostBatch, pack  # noqa: E402

ALL_BACKENDS = ("resident", "offload", "async_ep", "hybrid", "sync_ep", "tp")
BASELINES = ("sync_ep", "tp")
SINGLE_DEVICE = ("resident", "offload")
STREAMED = ("offload", "hybrid")
# "offload_waiting": offload with sync_lag=0 (wait for each layer before the next is
# dispatched), to compare with the lagged default in the same run.
WAITING = "_waiting"
CANDIDATES = 2


def base_backend(name: str) -> str:
    """The registered backend a benchmark entry runs ('offload_waiting' -> 'offload')."""
    if name.endswith(WAITING) and name[:-len(WAITING)] in STREAMED:
        return name[:-len(WAITING)]
    return name


# ==================================================================== trace parsing
# Lower-cased, '_' -> '-'. Matched as substrings (except the send/recv words).
TRANSFER_PATTERNS = (
    "all-gather", "allgather", "all-to-all", "alltoall", "all-reduce", "allreduce",
    "reduce-scatter", "reducescatter", "collective-permute", "collectivepermute",
    "collective-broadcast", "ragged-all-to-all", "copy-start", "copy-done", "copystart",
    "copydone", "memcpy", "h2d", "d2h", "host-to-device", "hosttodevice", "device-to-host",
    "devicetohost", "transfer", "device-put", "deviceput", "copytodevice", "copy-to-device",
    "nccl", "rccl", "psum", "pmax", "pmin", "ppermute", "pbroadcast")
TRANSFER_WORDS = re.compile(r"(^|[^a-z])(send|recv)([^a-z]|$)")
# Runtime bookkeeping, control flow wrapping other ops, host-side dispatch: neither.
OTHER_PATTERNS = (
    "threadpool", "thunkexecutor", "rendezvous", "wait", "execute", "handle input",
    "allocate", "createoutputs", "pjitfunction", "parsearguments", "shard-args",
    "garbage", "launch", "dispatch", "buffer", "prepare", "record")
MARKER_PREFIXES = ("end: ", "$")     # zero-length ends of ops; Python tracer frames
OTHER_PREFIXES = ("while", "conditional", "call", "command-buffer", "jit-")
# Trace lines (thread names) on a device that summarize or annotate, not run, work.
SKIPPED_LINES = ("xla modules", "steps", "framework", "tensorflow", "source", "async xla ops",
                 "launch stats", "counters", "scope", "xla traceme")
HOST_THREADS = ("python", "mainthread")


def normalize(name: str) -> str:
    return name.lower().replace("_", "-")


def classify(name: str) -> str:
    """'transfer', 'compute' or 'other' for one trace event name."""
    key = normalize(name)
    if key.startswith(MARKER_PREFIXES):
        return "other"
    if any(p in key for p in TRANSFER_PATTERNS) or TRANSFER_WORDS.search(key):
        return "transfer"
    if key.startswith(OTHER_PREFIXES) or any(p in key for p in OTHER_PATTERNS):
        return "other"
    return "compute"


def merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of [start, end) intervals as sorted disjoint intervals."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def length(merged: Sequence[tuple[float, float]]) -> float:
    return float(sum(e - s for s, e in merged))


def overlap(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> float:
    """Length of the intersection of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


@dataclasses.dataclass
class TraceSummary:
    """Seconds summed over lanes (a lane: one device, or on CPU one runtime thread).

    exposed_s: transfer time with no compute on the same lane. names: per class, event
    name (numbers stripped) -> seconds. device_lanes: whether lanes are device planes
    (GPU/TPU) or host threads (CPU)."""

    lanes: int
    transfer_s: float
    compute_s: float
    exposed_s: float
    device_lanes: bool
    names: dict[str, dict[str, float]]
    # For the split of exposed transfer by where it falls (:func:`split_exposed`):
    # lane -> merged exposed intervals; timeline -> program executions; first event.
    exposed: dict[Any, list[tuple[float, float]]] = dataclasses.field(default_factory=dict)
    programs: dict[Any, list["Program"]] = dataclasses.field(default_factory=dict)
    start_s: float = 0.0

    def top(self, kind: str, count: int = 6) -> list[tuple[str, float]]:
        return sorted(self.names.get(kind, {}).items(), key=lambda kv: -kv[1])[:count]


def metadata(events: Sequence[Mapping[str, Any]]) -> tuple[dict, dict]:
    """(pid -> process name, (pid, tid) -> thread name) from the 'M' events."""
    processes, threads = {}, {}
    for ev in events:
        if ev.get("ph") != "M":
            continue
        name = str(ev.get("args", {}).get("name", ""))
        if ev.get("name") == "process_name":
            processes[ev.get("pid")] = name
        elif ev.get("name") == "thread_name":
            threads[(ev.get("pid"), ev.get("tid"))] = name
    return processes, threads


HOST_LANE = "host"


def lane_of(ev: Mapping[str, Any], threads: Mapping, device_pids: set) -> Any:
    """The lane an event belongs to: a device plane (GPU/TPU), a runtime thread (CPU),
    :data:`HOST_LANE` for the Python thread on CPU (where host->device copies are issued
    and run), or None when it is not device work."""
    pid, tid = ev.get("pid"), ev.get("tid")
    line = threads.get((pid, tid), "").lower()
    if device_pids:                       # GPU/TPU: one lane per device plane
        if pid not in device_pids or any(s in line for s in SKIPPED_LINES):
            return None
        return pid
    if any(line.startswith(h) for h in HOST_THREADS):
        return HOST_LANE
    return (pid, tid)


def base_name(name: str) -> str:
    """'all_gather.3' -> 'all_gather'; '[2] foo' kept; digits-only suffixes dropped."""
    return re.sub(r"[.:]\d+$", "", name)


def subtract(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]
             ) -> list[tuple[float, float]]:
    """The parts of merged intervals ``a`` outside merged intervals ``b`` (merged)."""
    out: list[tuple[float, float]] = []
    j = 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, cursor = j, start
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                out.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def summarize_trace(trace: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> TraceSummary:
    """Transfer, compute and exposed transfer time of a Chrome-trace dict ('X' events,
    microsecond timestamps), per lane and summed (see the module docstring).

    Exposed = |∪ transfer − ∪ compute| on the same lane. The one exception is the CPU's
    host lane (the Python thread, whose only transfers are host->device copies): its
    transfers are exposed where no runtime thread computes at all."""
    events = trace.get("traceEvents", []) if isinstance(trace, Mapping) else list(trace)
    processes, threads = metadata(events)
    device_pids = {pid for pid, name in processes.items() if "/device:" in name}
    timed = [float(ev["ts"]) * 1e-6 for ev in events if ev.get("ph") == "X" and "ts" in ev]
    per_lane: dict[Any, dict[str, list]] = collections.defaultdict(
        lambda: {"transfer": [], "compute": []})
    names: dict[str, dict[str, float]] = {"transfer": {}, "compute": {}, "other": {}}
    for ev in events:
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        lane = lane_of(ev, threads, device_pids)
        if lane is None:
            continue
        kind = classify(str(ev.get("name", "")))
        if lane == HOST_LANE and kind == "compute":
            kind = "other"                # host-side work is not device compute
        start, dur = float(ev["ts"]) * 1e-6, float(ev["dur"]) * 1e-6
        key = base_name(str(ev.get("name", "")))
        names[kind][key] = names[kind].get(key, 0.0) + dur
        if kind != "other":
            per_lane[lane][kind].append((start, start + dur))
    all_compute = merge(iv for lane in per_lane.values() for iv in lane["compute"])
    transfer = compute = exposed = 0.0
    exposed_by_lane = {}
    for key, lane in per_lane.items():
        moving = merge(lane["transfer"])
        working = all_compute if key == HOST_LANE else merge(lane["compute"])
        transfer += length(moving)
        compute += length(merge(lane["compute"]))
        exposed += length(moving) - overlap(moving, working)
        exposed_by_lane[key] = subtract(moving, working)
    return TraceSummary(lanes=len(per_lane), transfer_s=transfer, compute_s=compute,
                        exposed_s=exposed, device_lanes=bool(device_pids), names=names,
                        exposed=exposed_by_lane,
                        programs=program_executions(events, threads, device_pids),
                        start_s=min(timed, default=0.0))


# ---------------------------------------------------------- where exposed transfer falls
# The streamed backends name their programs jit_streamed_{embed,gather,layer,last}.
STREAMED_PROGRAM = re.compile(r"streamed[-_](embed|gather|layer|last)")
CPU_TIMELINE = "cpu"          # on CPU the host devices share the cores: one timeline


@dataclasses.dataclass(frozen=True)
class Program:
    """One program execution on a timeline: [start, end) s, and its kind ('embed',
    'gather', 'layer', 'last' for a streamed backend's programs, else 'other')."""

    start: float
    end: float
    kind: str


def program_kind(module: str) -> str:
    found = STREAMED_PROGRAM.search(module.lower())
    return found.group(1) if found else "other"


def program_executions(events: Sequence[Mapping[str, Any]], threads: Mapping,
                       device_pids: set) -> dict[Any, list[Program]]:
    """Timeline -> its program executions, by start. GPU/TPU: a device plane's "XLA
    Modules" line (one event per execution). CPU (or a plane without that line): the
    ops of one execution share ``args.run_id`` and ``args.hlo_module``; its span runs
    from the first op's start to the last op's end."""
    modules: dict[Any, list[Program]] = collections.defaultdict(list)
    runs: dict[tuple, list[float]] = {}
    for ev in events:
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        pid = ev.get("pid")
        start = float(ev["ts"]) * 1e-6
        end = start + float(ev["dur"]) * 1e-6
        line = threads.get((pid, ev.get("tid")), "").lower()
        if pid in device_pids and "xla modules" in line:
            modules[pid].append(Program(start, end, program_kind(str(ev.get("name", "")))))
            continue
        args = ev.get("args") or {}
        if "hlo_module" in args and "run_id" in args:
            timeline = pid if device_pids else CPU_TIMELINE
            key = (timeline, str(args["hlo_module"]), str(args["run_id"]))
            span = runs.setdefault(key, [start, end])
            span[0], span[1] = min(span[0], start), max(span[1], end)
    with_line = set(modules)              # (their ops would count each program twice)
    for (timeline, module, _), (start, end) in runs.items():
        if timeline not in with_line:
            modules[timeline].append(Program(start, end, program_kind(module)))
    for spans in modules.values():
        spans.sort(key=lambda p: (p.start, p.end))
    return dict(modules)


STEP_START, BETWEEN_LAYERS = "step_start", "between_layers"


def gap_label(before: str | None, after: str | None) -> str | None:
    """What a gap between programs is, from the streamed programs either side of it
    (None: none there): the wait between two layers of a step, the stretch before a
    step's first layer (after the previous step's last program, or the trace's start:
    the embedding and hybrid's first gather fall there), or neither."""
    if before == "layer" and after in ("layer", "last"):
        return BETWEEN_LAYERS
    if before in (None, "last", "embed", "gather") and after in ("embed", "gather", "layer"):
        return STEP_START
    return None


def program_gaps(programs: Sequence[Program], start: float
                 ) -> list[tuple[float, float, str | None, bool]]:
    """The gaps of a timeline with no program running, from ``start`` (the trace's
    first event) to its last program: (start, end, :func:`gap_label`, whether it lies
    between two programs)."""
    streamed = [p for p in programs if p.kind != "other"]
    gaps, busy_until, seen = [], start, 0
    for i, program in enumerate(programs):
        if program.start > busy_until:
            before = next((p.kind for p in reversed(streamed[:seen])), None)
            after = next((p.kind for p in streamed[seen:]), None)
            gaps.append((busy_until, program.start, gap_label(before, after), i > 0))
        busy_until = max(busy_until, program.end)
        seen += program.kind != "other"
    return gaps


@dataclasses.dataclass
class ExposedSplit:
    """Seconds summed over timelines: exposed transfer before a step's first layer
    (``step_start_s``), in the waits between layers (``between_layers_s``) and
    elsewhere (``other_s``: e.g. during a program, between its kernels); the timelines'
    idle time between programs (``idle_s``), of which between layers
    (``idle_between_layers_s``)."""

    step_start_s: float
    between_layers_s: float
    other_s: float
    idle_s: float
    idle_between_layers_s: float


def split_exposed(summary: TraceSummary) -> ExposedSplit | None:
    """Where the exposed transfer of a streamed backend's trace falls (None without
    streamed programs in it). A lane's exposed intervals meet its device's gaps (on
    CPU, every lane meets the one CPU timeline)."""
    if not any(p.kind != "other" for spans in summary.programs.values() for p in spans):
        return None
    gaps = {timeline: program_gaps(spans, summary.start_s)
            for timeline, spans in summary.programs.items()}
    step = between = idle = idle_between = 0.0
    for timeline, timeline_gaps in gaps.items():
        idle += sum(e - s for s, e, _, inner in timeline_gaps if inner)
        idle_between += sum(e - s for s, e, label, _ in timeline_gaps
                            if label == BETWEEN_LAYERS)
    for lane, exposed in summary.exposed.items():
        timeline_gaps = gaps.get(lane if summary.device_lanes else CPU_TIMELINE, [])
        step += overlap(exposed, [(s, e) for s, e, label, _ in timeline_gaps
                                  if label == STEP_START])
        between += overlap(exposed, [(s, e) for s, e, label, _ in timeline_gaps
                                     if label == BETWEEN_LAYERS])
    return ExposedSplit(step_start_s=step, between_layers_s=between,
                        other_s=summary.exposed_s - step - between, idle_s=idle,
                        idle_between_layers_s=idle_between)


def find_trace_file(log_dir: str) -> str:
    """The newest ``*.trace.json.gz`` the profiler wrote under ``log_dir``."""
    found = glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.trace.json.gz"))
    if not found:
        raise FileNotFoundError(f"no *.trace.json.gz under {log_dir}/plugins/profile/")
    return max(found, key=os.path.getmtime)


def load_trace(path: str) -> dict:
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return json.load(fh)


# ==================================================================== model, workload
def model_shape(args) -> tuple[ModelConfig, str]:
    """The benchmark model and its dtype (see the module docstring)."""
    common = dict(model_type="qwen3_moe", norm_topk_prob=True, qk_norm=True, rms_norm_eps=1e-6,
                  rope_theta=1e6, tie_word_embeddings=False)
    if args.quick:
        shape = dict(vocab_size=512, hidden_size=64, num_layers=3, num_heads=16, num_kv_heads=8,
                     head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                     max_context=1024)
        dtype = "float32"
    elif is_gpu():
        shape = dict(vocab_size=151936, hidden_size=2048, num_layers=8, num_heads=32,
                     num_kv_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                     moe_intermediate_size=768, max_context=40960)
        dtype = "bfloat16"
    else:
        shape = dict(vocab_size=2048, hidden_size=256, num_layers=4, num_heads=16,
                     num_kv_heads=8, head_dim=16, num_experts=32, num_experts_per_tok=4,
                     moe_intermediate_size=256, max_context=4096)
        dtype = "float32"
    if args.layers:
        shape["num_layers"] = args.layers
    return ModelConfig(**shape, **common), args.dtype or dtype


def workload_shape(args) -> tuple[int, int]:
    """(attention block = longest sequence, tokens per batch), both powers of two."""
    if args.quick:
        block, tokens = 32, 128
    elif is_gpu():
        block, tokens = 512, 16384
    else:
        block, tokens = 128, 1024
    block, tokens = args.block or block, args.batch_tokens or tokens
    if block & (block - 1) or tokens & (tokens - 1) or tokens < block:
        raise SystemExit(f"--block ({block}) and --batch-tokens ({tokens}) must be powers of "
                         f"two with batch tokens >= block")
    return block, tokens


def make_workload(cfg: ModelConfig, num_batches: int, block: int, batch_tokens: int,
                  seed: int = 0) -> list[HostBatch]:
    """``num_batches`` full batches of one shape: sequences of block/2+1 … block tokens,
    one per attention block, each scored at its last position over 2 candidates."""
    per_batch = batch_tokens // block
    rng = np.random.default_rng(seed)
    sequences = []
    for i in range(num_batches * per_batch):
        n = int(rng.integers(block // 2 + 1, block + 1))
        sequences.append(PrefillOp(
            key=i, token_ids=rng.integers(0, cfg.vocab_size, n).astype(np.int32),
            score_positions=(n - 1,),
            score_token_ids=(tuple(int(t) for t in rng.integers(0, cfg.vocab_size, CANDIDATES)),)))
    hosts = pack(sequences, BucketPolicy(max_batch_tokens=batch_tokens, min_block=block))
    shapes = {h.shape_key for h in hosts}
    if len(shapes) != 1 or len(hosts) != num_batches:
        raise AssertionError(f"workload packed into {len(hosts)} batches of shapes {shapes}")
    return hosts


def useful_flops(cfg: ModelConfig, hosts: Sequence[HostBatch]) -> float:
    """DESIGN.md's FLOPs of every real sequence (no padding)."""
    return float(sum(cfg.request_flops(len(s.token_ids), 0, scoring_positions=len(s.score_positions),
                                       num_candidates=CANDIDATES)
                     for h in hosts for s in h.sequences))


# ==================================================================== platform, peak
def is_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda", "rocm")


# (device-kind substring, dtype) -> dense TFLOP/s (SXM datasheets; f32 without tensor cores)
PEAK_TABLE = {("h200", "bfloat16"): 989.0, ("h200", "float32"): 67.0,
              ("h100 pcie", "bfloat16"): 756.0, ("h100 pcie", "float32"): 51.0,
              ("h100", "bfloat16"): 989.0, ("h100", "float32"): 67.0}


def measured_matmul_tflops(dtype: str, size: int = 2048, repeats: int = 5) -> float:
    """Rate of a large matmul on device 0, median of ``repeats`` (synchronized)."""
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    a = jax.device_put(jnp.asarray(rng.standard_normal((size, size)), dtype), jax.devices()[0])
    b = jax.device_put(jnp.asarray(rng.standard_normal((size, size)), dtype), jax.devices()[0])
    f = jax.jit(jnp.matmul)
    jax.block_until_ready(f(a, b))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(f(a, b))
        times.append(time.perf_counter() - start)
    return 2 * size ** 3 / statistics.median(times) / 1e12


def device_peak(args, dtype: str) -> tuple[float, str]:
    """(peak TFLOP/s per device, where it came from)."""
    if args.peak_tflops:
        return args.peak_tflops, "--peak-tflops"
    kind = jax.devices()[0].device_kind.lower()
    for (sub, dt), value in PEAK_TABLE.items():
        if sub in kind and dt == dtype:
            return value, f"table ({jax.devices()[0].device_kind}, {dtype})"
    return measured_matmul_tflops(dtype), "measured matmul"


def mfu_devices(num_devices: int) -> int:
    """Devices the peak is multiplied by: on CPU the host devices share one machine."""
    return 1 if jax.default_backend() == "cpu" else num_devices


# ==================================================================== backends
def backend_devices(name: str, cfg: ModelConfig, devices: int) -> int:
    """Devices a backend runs on: 1 for the single-device ones; tp shards attention by
    head, so it gets the largest count dividing both head counts."""
    name = base_backend(name)
    if name in SINGLE_DEVICE:
        return 1
    if name == "tp":
        return max(g for g in range(1, devices + 1)
                   if cfg.num_heads % g == 0 and cfg.num_kv_heads % g == 0)
    return devices


def backend_options(name: str, args, dtype: str) -> dict[str, Any]:
    options: dict[str, Any] = {"dtype": dtype}
    base = base_backend(name)
    if base in STREAMED:
        options["window"] = max(args.window, 2) if base == "hybrid" else args.window
        if name != base:
            options["sync_lag"] = 0
        elif args.sync_lag is not None:
            options["sync_lag"] = args.sync_lag
    return options


def build_backend(name: str, cfg: ModelConfig, params, devices: int, options: Mapping):
    """The backend, or (None, reason) when it cannot be built here."""
    try:
        return make_backend(base_backend(name), cfg, params, devices=devices, **options), None
    except (ImportError, AttributeError) as exc:
        return None, f"not importable ({type(exc).__name__}: {exc})"
    except (BackendError, ValueError) as exc:
        return None, f"cannot run here ({exc})"


def sync_each_step(backend, force: bool = False) -> bool:
    """Wait for every step before dispatching the next? On CPU with several host devices,
    yes: with steps of a collective program in flight, XLA:CPU was seen to deadlock in a
    collective rendezvous (and abort the process after its 40 s timeout)."""
    return force or (jax.default_backend() == "cpu" and len(backend.devices) > 1)


def run_workload(backend, hosts: Sequence[HostBatch], sync: bool = False) -> None:
    """Every batch through ``backend`` in steps of its rank count; waits for the results
    (after each step when ``sync``, else once at the end)."""
    outputs = []
    for step in plan_steps([h.shape_key for h in hosts], backend.num_ranks):
        batches = padded_step([hosts[i].batch for i in step], backend.num_ranks)
        outputs.append(backend.step(batches, hosts[step[0]].options))
        if sync:
            jax.block_until_ready(outputs[-1])
    jax.block_until_ready(outputs)


def timed_pass(backend, hosts: Sequence[HostBatch], sync: bool = False) -> float:
    start = time.perf_counter()
    run_workload(backend, hosts, sync)
    return time.perf_counter() - start


def traced_pass(backend, hosts: Sequence[HostBatch], log_dir: str, sync: bool = False
                ) -> tuple[float, TraceSummary]:
    """One pass under ``jax.profiler.trace`` (no Python tracer): (wall s, summary)."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    with jax.profiler.trace(log_dir, profiler_options=options):
        wall = timed_pass(backend, hosts, sync)
    return wall, summarize_trace(load_trace(find_trace_file(log_dir)))


def expected_saving(name: str, cfg: ModelConfig, devices: int, window: int,
                    sync_lag: int = 0) -> float:
    """The expert-memory saving per device DESIGN.md's table implies (from first
    principles, not from the backend's own report)."""
    L, E, G = cfg.num_layers, cfg.num_experts, devices
    padded = -(-E // G) * G
    name = base_backend(name)
    if name == "offload":             # W layers, whatever the lag
        return L / min(window, L)
    if name == "async_ep":            # 1/G of every layer + layer 0 whole + two gathered
        return L * E / (L * padded / G + 3 * E)
    if name == "hybrid":              # W shard-layers + two gathered + one per lagged layer
        return L * E / (min(window, L) * padded / G + (2 + sync_lag) * E)
    if name == "sync_ep":
        return E / (padded / G)
    if name == "tp":
        f = cfg.moe_intermediate_size
        return f / (-(-f // G))
    return 1.0


# ---------------------------------------------------------- compiled temp (activation) bytes
def peak_temp_bytes(backend, host: HostBatch) -> tuple[int | None, str]:
    """Largest ``temp_size_in_bytes`` of the step's compiled program(s) (activations and
    in-program buffers such as gathered experts), else the device's peak bytes in use."""
    try:
        sizes = [lowered.compile().memory_analysis().temp_size_in_bytes
                 for lowered in backend.lowered_steps(
                     padded_step([host.batch], backend.num_ranks), host.options)]
        return int(max(sizes)), "compiled memory_analysis"
    except Exception as exc:  # noqa: BLE001  (the figure is optional)
        stats = backend.devices[0].memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            return int(stats["peak_bytes_in_use"]), "device peak_bytes_in_use (all buffers)"
        return None, f"unavailable ({type(exc).__name__}: {exc})"


# ---------------------------------------------------------- one backend, measured
@dataclasses.dataclass
class Result:
    name: str
    devices: int
    wall_s: float
    tokens_per_s: float
    mfu: float
    traced_wall_s: float
    trace: TraceSummary
    exposed_fraction: float
    memory: dict[str, Any]
    expected_saving: float
    peak_temp: int | None
    peak_temp_source: str
    theta: float
    theta_source: str
    t_x: float | None
    channel: str
    batch_over_theta: float
    live_window_bytes: int | None
    synced_steps: bool
    split: ExposedSplit | None = None     # streamed backends: where exposed transfer falls
    sync_lag: int | None = None


def measure_backend(name: str, backend, hosts: Sequence[HostBatch], ctx: Mapping[str, Any]
                    ) -> Result:
    from moejax.calibrate import calibrate

    args, cfg = ctx["args"], ctx["cfg"]
    sync = sync_each_step(backend, args.sync_steps)
    run_workload(backend, hosts, sync)                             # warm-up: compiles
    calibration = calibrate(backend, reference_tokens=ctx["batch_tokens"],
                            reference_sequence=ctx["block"], repeats=args.calib_repeats,
                            max_batch_tokens=ctx["batch_tokens"])
    batch_over_theta = ctx["batch_flops"] / calibration.theta if calibration.theta else math.inf
    print(f"  [{name}] Θ = {calibration.theta:.3g} FLOPs ({calibration.source}; t_x = "
          f"{_ms(calibration.t_x)} over {calibration.channel}, R = "
          f"{_tflops(calibration.rate)}); one batch = {batch_over_theta:.3g} Θ"
          f"{'; synchronized after every step' if sync else ''}", flush=True)
    wall = statistics.median(timed_pass(backend, hosts, sync) for _ in range(args.repeats))
    live = live_window(backend, hosts, sync)
    log_dir = os.path.join(ctx["trace_root"], name)
    traced_wall, summary = traced_pass(backend, hosts, log_dir, sync)
    devices = len(backend.devices)
    peak = ctx["peak_tflops"] * 1e12 * mfu_devices(devices)
    temp, temp_source = peak_temp_bytes(backend, hosts[0])
    lag = getattr(backend, "sync_lag", None)
    return Result(
        name=name, devices=devices, wall_s=wall, tokens_per_s=ctx["tokens"] / wall,
        mfu=ctx["flops"] / (wall * peak), traced_wall_s=traced_wall, trace=summary,
        exposed_fraction=summary.exposed_s / (traced_wall * devices),
        memory=backend.memory_report().as_dict(),
        expected_saving=expected_saving(name, cfg, devices, getattr(backend, "window", 0),
                                        lag or 0),
        peak_temp=temp, peak_temp_source=temp_source, theta=calibration.theta,
        theta_source=calibration.source, t_x=calibration.t_x, channel=calibration.channel,
        batch_over_theta=batch_over_theta, live_window_bytes=live, synced_steps=sync,
        split=split_exposed(summary) if base_backend(name) in STREAMED else None, sync_lag=lag)


def live_window(backend, hosts: Sequence[HostBatch], sync: bool) -> int | None:
    """For the streamed backends: the peak expert bytes per device seen in JAX's live
    arrays during one (untimed) pass — a measurement beside the report's bookkeeping."""
    if not hasattr(backend, "track_memory"):
        return None
    backend.track_memory, backend.peak_window_bytes = True, 0
    try:
        run_workload(backend, hosts, sync)
    finally:
        backend.track_memory = False
    return int(backend.peak_window_bytes)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.3g} ms"


def _tflops(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate / 1e12:.3g} TFLOP/s"


# ==================================================================== report
def ratios(results: Mapping[str, Result]) -> dict[str, dict[str, float | None]]:
    resident = results.get("resident")
    baselines = [results[b].tokens_per_s for b in BASELINES if b in results]
    best = max(baselines) if baselines else None
    return {name: {"over_resident": r.tokens_per_s / resident.tokens_per_s if resident else None,
                   "over_best_baseline": r.tokens_per_s / best if best else None}
            for name, r in results.items()}


def _fmt(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def print_table(results: Mapping[str, Result], rel: Mapping[str, Mapping]) -> None:
    header = (f"{'backend':<16}{'dev':>4}{'wall s':>9}{'tok/s':>10}{'tok/s/dev':>10}"
              f"{'×resid':>8}{'×best_bl':>9}{'MFU %':>7}{'exp.xfer %':>11}{'expert MiB/dev':>15}"
              f"{'saving ×':>9}{'expect ×':>9}{'temp MiB':>9}{'Θ FLOPs':>10}")
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        mib = r.memory["expert_weight_bytes"] / 2 ** 20
        temp = None if r.peak_temp is None else r.peak_temp / 2 ** 20
        print(f"{name:<16}{r.devices:>4}{r.wall_s:>9.3f}{r.tokens_per_s:>10.0f}"
              f"{r.tokens_per_s / r.devices:>10.0f}{_fmt(rel[name]['over_resident'], '.2f'):>8}"
              f"{_fmt(rel[name]['over_best_baseline'], '.2f'):>9}{100 * r.mfu:>7.2f}"
              f"{100 * r.exposed_fraction:>11.1f}{mib:>15.2f}"
              f"{r.memory['expert_saving']:>9.2f}{r.expected_saving:>9.2f}"
              f"{_fmt(temp, '.1f'):>9}{r.theta:>10.3g}")


def print_memory(results: Mapping[str, Result]) -> None:
    print("\nweights per device (bytes; from memory_report(); 'live peak' = expert arrays held "
          "between programs, measured from jax.live_arrays during a pass; buffers inside a "
          "program, e.g. a layer gathered in flight, count in its temp bytes instead):")
    for name, r in results.items():
        m = r.memory
        detail = ", ".join(f"{k}={v}" for k, v in m["detail"].items())
        live = "" if r.live_window_bytes is None else f", live peak={r.live_window_bytes}"
        match = "matches" if math.isclose(m["expert_saving"], r.expected_saving, rel_tol=1e-6) \
            else "DIFFERS from"
        print(f"  {name:<16} dense={m['dense_weight_bytes']} experts={m['expert_weight_bytes']} "
              f"(all layers {m['expert_bytes_all_layers']}, host {m['host_weight_bytes']}"
              f"{'; ' + detail if detail else ''}{live}); saving {m['expert_saving']:.2f}× "
              f"{match} the expected {r.expected_saving:.2f}×; peak temp "
              f"{_fmt(r.peak_temp, 'd', 'n/a')} ({r.peak_temp_source})")


def print_trace_details(results: Mapping[str, Result]) -> None:
    print("\ntrace (traced pass; seconds summed over lanes; lanes = device planes on GPU/TPU, "
          "runtime threads on CPU):")
    for name, r in results.items():
        t = r.trace
        print(f"  {name:<16} wall {r.traced_wall_s:.3f} s, {t.lanes} lanes, compute "
              f"{t.compute_s:.3f} s, transfer {t.transfer_s:.3f} s, exposed {t.exposed_s:.3f} s "
              f"({100 * r.exposed_fraction:.1f}% of wall × {r.devices} device(s))")
        transfers = ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in t.top("transfer", 8))
        computes = ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in t.top("compute", 4))
        print(f"      transfer events: {transfers or 'none'}")
        print(f"      top compute events: {computes or 'none'}")


def _pct(seconds: float, r: Result) -> str:
    return f"{100 * seconds / (r.traced_wall_s * r.devices):.1f}%"


def print_exposed_split(results: Mapping[str, Result]) -> None:
    streamed = [name for name in results if base_backend(name) in STREAMED]
    missing = [name for name in streamed if results[name].split is None]
    if missing:
        print(f"\nno streamed program executions found in the trace of {', '.join(missing)} "
              f"(looked for an \"XLA Modules\" line per device, or ops with hlo_module and "
              f"run_id args): exposed transfer not split")
    rows = {name: results[name] for name in streamed if results[name].split is not None}
    if not rows:
        return
    print("\nwhere the streamed backends' exposed transfer falls (% of traced wall × devices): "
          "step start = before a step's first layer program (from the previous step's last "
          "program: the embedding and hybrid's first gather are there); between layers = "
          "the device waiting between two layer programs of a step; other = the rest (e.g. "
          "inside a program). idle = no program running, between programs:")
    for name, r in rows.items():
        sp = r.split
        print(f"  {name:<16} sync_lag {r.sync_lag}: exposed {_pct(r.trace.exposed_s, r)} = "
              f"step start {_pct(sp.step_start_s, r)} + between layers "
              f"{_pct(sp.between_layers_s, r)} + other {_pct(sp.other_s, r)}; device idle "
              f"{_pct(sp.idle_s, r)} (between layers {_pct(sp.idle_between_layers_s, r)})")


def lag_ratios(results: Mapping[str, Result]) -> dict[str, float]:
    """tokens/s of each streamed backend run lagged over the same run waiting (both in
    this run: ``--backends offload,offload_waiting``)."""
    return {f"{b}_lagged_over_waiting": results[b].tokens_per_s / results[b + WAITING].tokens_per_s
            for b in STREAMED if b in results and b + WAITING in results}


LAG_CPU_NOTE = ("note (CPU): the lagged/waiting ratio is not the GPU figure: CPU copies run "
                "on the Python thread and the programs share the same cores, so there is no "
                "copy engine for the lag to keep busy beside compute. Measure it on a GPU.")


def print_lag_ratios(results: Mapping[str, Result]) -> None:
    for key, ratio in lag_ratios(results).items():
        base = key[:-len("_lagged_over_waiting")]
        print(f"\n{base}: sync_lag {results[base].sync_lag} over sync_lag 0 "
              f"({base}{WAITING}): {ratio:.3f}× tokens/s (measured one after the other, "
              f"same workload)")
        if jax.default_backend() == "cpu":
            print(LAG_CPU_NOTE)


def json_figures(results: Mapping[str, Result], rel: Mapping, ctx: Mapping, skipped: Mapping
                 ) -> dict[str, Any]:
    out: dict[str, Any] = {
        "platform": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
        "peak_tflops": ctx["peak_tflops"], "peak_source": ctx["peak_source"],
        "dtype": ctx["dtype"], "devices": ctx["devices"], "tokens": ctx["tokens"],
        "padded_tokens": ctx["padded_tokens"], "useful_flops": ctx["flops"],
        "skipped": dict(skipped)}
    for name, r in results.items():
        out.update({
            f"{name}_tokens_per_s": r.tokens_per_s,
            f"{name}_tokens_per_s_per_device": r.tokens_per_s / r.devices,
            f"{name}_mfu": r.mfu,
            f"{name}_exposed_transfer_fraction": r.exposed_fraction,
            f"{name}_over_resident": rel[name]["over_resident"],
            f"{name}_over_best_baseline": rel[name]["over_best_baseline"],
            f"{name}_expert_bytes_per_device": r.memory["expert_weight_bytes"],
            f"{name}_expert_saving": r.memory["expert_saving"],
            f"{name}_expected_expert_saving": r.expected_saving,
            f"{name}_peak_temp_bytes": r.peak_temp,
            f"{name}_theta_flops": r.theta,
            f"{name}_batch_over_theta": r.batch_over_theta if math.isfinite(r.batch_over_theta)
            else None,
            f"{name}_devices": r.devices,
            f"{name}_wall_s": r.wall_s})
        if r.split is not None:
            out.update(split_figures(name, r.split, r.traced_wall_s * r.devices, r.sync_lag))
    out.update(lag_ratios(results))
    return out


def split_figures(name: str, split: ExposedSplit, wall_devices_s: float, sync_lag: int | None
                  ) -> dict[str, Any]:
    """A streamed backend's exposed-transfer split as fractions of traced wall × devices
    (``wall_devices_s``), the denominator of ``B_exposed_transfer_fraction``."""
    return {f"{name}_sync_lag": sync_lag,
            f"{name}_exposed_first_layer_fraction": split.step_start_s / wall_devices_s,
            f"{name}_exposed_between_layers_fraction": split.between_layers_s / wall_devices_s,
            f"{name}_exposed_other_fraction": split.other_s / wall_devices_s,
            f"{name}_device_idle_fraction": split.idle_s / wall_devices_s,
            f"{name}_idle_between_layers_fraction": split.idle_between_layers_s / wall_devices_s}


CPU_NOTE = ("note (CPU): the trace shows the mechanics only. CPU collectives are synchronous "
            "(a device's thread computes nothing while it waits in the rendezvous), so they are "
            "exposed by construction; host->device copies run on the Python thread (counted "
            "exposed where no runtime thread computes); there are no copy/communication streams. "
            "Lanes are runtime threads, not devices, and the 8 host devices share the same "
            "cores, so the multi-device rows do not scale. Overlap is a GPU measurement.")


# ==================================================================== main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, under a minute on CPU")
    parser.add_argument("--json", dest="json_path", help="write the figures to this JSON file")
    parser.add_argument("--backends", default=",".join(ALL_BACKENDS),
                        help="comma list (default: all six)")
    parser.add_argument("--devices", type=int, help="G for the multi-device backends "
                        "(default: every device)")
    parser.add_argument("--window", type=int, default=2, help="offload/hybrid window (layers)")
    parser.add_argument("--sync-lag", type=int, help="offload/hybrid: layer programs "
                        "dispatched ahead of the one the host waits for (default: the "
                        "backend's, 1). Add e.g. offload_waiting to --backends for the same "
                        "backend with sync_lag 0, side by side")
    parser.add_argument("--layers", type=int, help="decoder layers (GPU default 8)")
    parser.add_argument("--block", type=int, help="attention block = longest sequence "
                        "(power of two; default 512 GPU, 128 CPU, 32 quick)")
    parser.add_argument("--batch-tokens", type=int, help="tokens per packed batch (power of "
                        "two; default 16384 GPU, 1024 CPU, 128 quick). offload hides its copies "
                        "only when one batch is >= Θ: see 'one batch = x Θ'")
    parser.add_argument("--sync-steps", action="store_true", help="wait for every step before "
                        "the next (always on for multi-device backends on CPU)")
    parser.add_argument("--steps", type=int, default=2,
                        help="batches per data-parallel rank: the workload is G·steps batches")
    parser.add_argument("--repeats", type=int, help="timed passes, median kept (default 3; "
                        "1 with --quick)")
    parser.add_argument("--calib-repeats", type=int, default=2, help="calibrate() repeats")
    parser.add_argument("--peak-tflops", type=float, help="device peak used for MFU")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"),
                        help="weights/activations (default bf16 on GPU, f32 on CPU)")
    parser.add_argument("--trace-dir", help="keep the profiler traces here (default: a "
                        "temporary directory, removed at the end)")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 3)
    unknown = [b for b in args.backends.split(",") if base_backend(b) not in BACKENDS]
    if unknown:
        parser.error(f"unknown backend(s) {unknown}; choose from {sorted(BACKENDS)} "
                     f"(or {', '.join(b + WAITING for b in STREAMED)})")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from moejax.model import init_params

    args = parse_args(argv)
    cfg, dtype = model_shape(args)
    devices = args.devices or len(jax.devices())
    block, batch_tokens = workload_shape(args)
    hosts = make_workload(cfg, devices * args.steps, block, batch_tokens)
    peak_tflops, peak_source = device_peak(args, dtype)
    trace_root = args.trace_dir or tempfile.mkdtemp(prefix="moejax-backends-trace-")
    ctx = {"args": args, "cfg": cfg, "dtype": dtype, "devices": devices, "block": block,
           "batch_tokens": batch_tokens, "tokens": sum(h.real_tokens for h in hosts),
           "padded_tokens": len(hosts) * batch_tokens, "flops": useful_flops(cfg, hosts),
           "batch_flops": useful_flops(cfg, hosts) / len(hosts),
           "peak_tflops": peak_tflops, "peak_source": peak_source, "trace_root": trace_root}
    print(f"backends on {jax.default_backend()} ({jax.devices()[0].device_kind}), {devices} "
          f"device(s); Qwen3-MoE d={cfg.hidden_size} L={cfg.num_layers} E={cfg.num_experts} "
          f"k={cfg.num_experts_per_tok} f={cfg.moe_intermediate_size} V={cfg.vocab_size}, "
          f"{dtype}, random weights")
    print(f"workload: {len(hosts)} batches of {batch_tokens} tokens (block {block}), "
          f"{ctx['tokens']} real tokens, {ctx['flops']:.3g} useful FLOPs; peak "
          f"{peak_tflops:.3g} TFLOP/s per device ({peak_source}); median of {args.repeats} "
          f"timed pass(es)", flush=True)
    params = init_params(cfg, seed=0, dtype=np.float32)
    results: dict[str, Result] = {}
    skipped: dict[str, str] = {}
    try:
        for name in args.backends.split(","):
            count = backend_devices(name, cfg, devices)
            backend, why = build_backend(name, cfg, params, count,
                                         backend_options(name, args, dtype))
            if backend is None:
                skipped[name] = why
                print(f"  [{name}] skipped: {why}", flush=True)
                continue
            if name == "tp" and count != devices:
                print(f"  [tp] runs on {count} device(s): heads {cfg.num_heads}/"
                      f"{cfg.num_kv_heads} are not divisible by {devices}")
            try:
                results[name] = measure_backend(name, backend, hosts, ctx)
            except Exception as exc:  # noqa: BLE001  (one broken backend must not end the run)
                skipped[name] = f"failed while running ({type(exc).__name__}: {exc})"
                print(f"  [{name}] skipped: {skipped[name]}", flush=True)
            del backend
            gc.collect()          # jitted closures keep the backend (and its buffers) alive
    finally:
        if not args.trace_dir:
            shutil.rmtree(trace_root, ignore_errors=True)
    rel = ratios(results)
    print()
    print_table(results, rel)
    print_memory(results)
    print_trace_details(results)
    print_exposed_split(results)
    print_lag_ratios(results)
    if jax.default_backend() == "cpu":
        print("\n" + CPU_NOTE)
        print("MFU on CPU: peak = measured matmul of the whole machine; device factor 1 "
              "(the forced host devices share its cores).")
    figures = json_figures(results, rel, ctx, skipped)
    write_json(args.json_path, figures)
    return figures


if __name__ == "__main__":
    main()
