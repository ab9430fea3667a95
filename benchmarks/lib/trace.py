"""Profiler (Chrome trace) parsing, and the attribution of device time in it.

A pass run under :func:`profile` (``jax.profiler.trace``, no Python tracer) leaves a
Chrome-trace JSON (``plugins/profile/<run>/<host>.trace.json.gz``). Its events are put
into lanes (:func:`lane_of`: a device plane on GPU/TPU, a runtime thread on CPU, the host
lane for the Python thread on CPU) and classified (:func:`classify`) as *transfer*
(collectives, host<->device copies), *compute* (kernels / fused ops) or *other*
(runtime, control flow, host); :func:`summarize_trace` sums them per lane with

    exposed transfer = |∪ transfer intervals| − |∪ transfer ∩ ∪ compute|   (per lane)

i.e. the time a device moves data with no compute running. :func:`program_executions`
reads the program executions (GPU: a device plane's "XLA Modules" line; CPU: the ops
sharing one ``run_id``) and :func:`split_exposed` splits a streamed backend's exposed
transfer by the gaps between its programs (step start, between layers, other).
:func:`device_events` lists the device work of a trace (for per-call or per-stage
attribution), :func:`split_time` shares each instant between the labels running then.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import glob
import gzip
import json
import os
import re
import shutil
import tempfile
from typing import Any, Iterable, Iterator, Mapping, Sequence

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




@dataclasses.dataclass
class Captured:
    """What :func:`profile` captured: the Chrome trace (set when the block ends)."""

    trace: dict = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def profile(log_dir: str | None = None, python_tracer: bool = False) -> Iterator[Captured]:
    """Run the block under ``jax.profiler.trace`` and load the Chrome trace it wrote into
    the yielded :class:`Captured`. ``log_dir``: where the profile is kept (default: a
    temporary folder, removed afterwards). The Python tracer is off unless asked for (its
    events are host work and slow the traced pass)."""
    import jax

    folder = log_dir or tempfile.mkdtemp(prefix="moejax-trace-")
    captured = Captured()
    try:
        options = jax.profiler.ProfileOptions()
        if not python_tracer:
            options.python_tracer_level = 0
        with jax.profiler.trace(folder, profiler_options=options):
            yield captured
        captured.trace = load_trace(find_trace_file(folder))
    finally:
        if not log_dir:
            shutil.rmtree(folder, ignore_errors=True)


def device_work(trace: Mapping[str, Any] | Sequence[Mapping[str, Any]]
                ) -> tuple[bool, list[tuple[Any, Mapping[str, Any]]]]:
    """(whether the lanes are device planes, [(lane, event)]) for the complete events of
    device work in a trace: on a GPU/TPU every event of a device plane's working lines,
    on CPU the runtime threads' events (not the Python thread's); markers left out."""
    events = trace.get("traceEvents", []) if isinstance(trace, Mapping) else list(trace)
    processes, threads = metadata(events)
    device_pids = {pid for pid, name in processes.items() if "/device:" in name}
    out = []
    for ev in events:
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        if str(ev.get("name", "")).startswith(MARKER_PREFIXES):
            continue
        lane = lane_of(ev, threads, device_pids)
        if lane is not None and lane != HOST_LANE:
            out.append((lane, ev))
    return bool(device_pids), out


def split_time(intervals: Iterable[tuple[float, float, str]]) -> dict[str, float]:
    """Seconds per label over the union of [start, end) intervals: every instant is
    split equally between the distinct labels running then."""
    edges: list[tuple[float, int, str]] = []
    for start, end, label in intervals:
        if end > start:
            edges += [(start, 1, label), (end, -1, label)]
    edges.sort(key=lambda e: (e[0], e[1]))
    active: collections.Counter[str] = collections.Counter()
    out: dict[str, float] = collections.defaultdict(float)
    previous = None
    for time_s, step, label in edges:
        running = [name for name, count in active.items() if count > 0]
        if previous is not None and running and time_s > previous:
            for name in running:
                out[name] += (time_s - previous) / len(running)
        active[label] += step
        previous = time_s
    return dict(out)
