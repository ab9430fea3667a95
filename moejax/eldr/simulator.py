"""A discrete-event simulator of K continuous-batching decoders, for ELDR at scale
(issue 17, "Simulated part, for scale").

Why a simulator: routing never changes tokens, so each request's decode-time expert ids
are fixed by its trace whatever decoder serves it. Replaying them on K simulated decoders
under a cost model gives the TPOT a routing policy would produce, for K and arrival
rates the real run cannot reach. Routing is the real thing: :func:`simulate` calls the
same :class:`moejax.eldr.policies.Policy` objects as the runtime, never a copy.

Model:

* A request (:class:`SimRequest`) reaches the prefill→decode hand-off at its arrival
  time, is routed once (``policy.choose(HandOff(counts, domain), loads)``, ``loads`` =
  each decoder's in-flight requests, running + waiting, at that moment) and joins the
  chosen decoder's FIFO queue.
* A decoder runs steps back to back while it has work. At each step boundary finished
  requests leave, then waiting ones join (FIFO) up to ``max_batch_size`` running. A
  step takes every running request one decode token forward; its duration is
  :meth:`CostModel.step_seconds` of the union, per layer, of the expert ids the rows
  chose at their current step. A request leaves after its D-th decode token. An idle
  decoder starts a step at the moment a request joins it.
* Events run in time order (one :class:`moejax.events.EventQueue`). Ties: at one
  instant, every arrival is routed first (in arrival order), then decoder boundaries
  run, lowest decoder index first. So a request finishing at the instant another
  arrives still counts in the load the router sees, and requests arriving together at
  an idle decoder start their first step together.

When a finished request gives its row (and its load) back is the ``release`` mode of
:func:`simulate` (:data:`RELEASE_MODES`); the default, ``"at_boundary"``, is the model
above. The other two are the real prefill→decode pipeline's
(:class:`moejax.core.decoders.DecoderPool`, one time unit per pool step), which
:mod:`moejax.eldr.replay` replays exactly:

* ``"before_arrivals"`` (unpipelined decoders, ``SchedulerOptions.pipelined=False``): a
  decoder reads its step's tokens within the step, so a request finishing at t has left
  before the hand-offs of t are routed: at one instant, finished requests leave first
  (lowest decoder index first), then arrivals are routed, then waiting ones join;
* ``"step_late"`` (pipelined decoders, the default): a decoder reads a step's tokens
  during its next step, after planning it, so a request whose last token is in flight
  holds its row, and counts in the loads, through one more step in which it runs no
  row; it leaves at the end of that step, before the next instant's arrivals are
  routed. Its ``finish`` is the end of its last decode step; a step whose rows are all
  held is recorded with batch 0.

TPOT here is (finish − arrival) / D: the time from the hand-off to the last decode token
per decode token, queueing at the decoder included (a request that waits for a batch
slot pays for it). The prefill and its first token are outside the simulation.

:func:`poisson_arrivals` and :func:`rate_for_batch` make arrival traces;
:func:`requests_from_trace` builds requests from a :class:`moejax.traces.Trace`;
:func:`shuffled_signatures` is the noise floor's ``signatures_of``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from jaxtyping import Float, Integer

from moejax import traces as traces_lib
from moejax.eldr.policies import HandOff, Policy
from moejax.events import EventQueue

RELEASE_MODES = ("at_boundary", "before_arrivals", "step_late")
"""When a finished request leaves its decoder (module docstring)."""

COST_KEYS = ("t0_s", "a_s", "b_s")
"""The keys of a cost-model JSON file (per layer, seconds); other keys are metadata."""


def _check_seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) \
            or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    return float(value)


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _check_positive(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


# ----------------------------------------------------------------------------- cost
@dataclasses.dataclass(frozen=True)
class CostModel:
    """Decode step time t = t0 + Σ_l (a·|active experts at l| + b·batch), in seconds:
    ``t0`` for the whole step (everything that does not scale with experts or batch),
    ``a`` per active expert per layer (loading its weights), ``b`` per batch row per
    layer."""

    t0: float
    a: float
    b: float

    def __post_init__(self) -> None:
        for name in ("t0", "a", "b"):
            object.__setattr__(self, name, _check_seconds(f"CostModel.{name}", getattr(self, name)))

    @classmethod
    def from_per_layer(cls, t0_layer: float, a: float, b: float, num_layers: int) -> CostModel:
        """From a per-layer fit (one MoE layer timed: t_layer = t0_layer + a·active +
        b·batch): the step's t0 is num_layers · t0_layer."""
        num_layers = _check_positive_int("num_layers", num_layers)
        return cls(t0=num_layers * _check_seconds("t0_layer", t0_layer), a=a, b=b)

    @classmethod
    def from_file(cls, path: str | os.PathLike, *, num_layers: int) -> CostModel:
        """From a cost-model JSON file (``benchmarks/data/``): an object whose ``t0_s``,
        ``a_s``, ``b_s`` are the PER-LAYER fit in seconds (other keys are metadata and
        ignored), for a model of ``num_layers`` MoE layers (step t0 = num_layers·t0_s)."""
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{os.fspath(path)}: not a JSON cost model ({exc})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{os.fspath(path)}: a cost model is a JSON object with keys "
                             f"{COST_KEYS}, got {type(data).__name__}")
        missing = [key for key in COST_KEYS if key not in data]
        if missing:
            raise ValueError(f"{os.fspath(path)}: cost model has no {', '.join(missing)} "
                             f"(needs {COST_KEYS}, per layer, in seconds)")
        try:
            return cls.from_per_layer(data["t0_s"], data["a_s"], data["b_s"], num_layers)
        except ValueError as exc:
            raise ValueError(f"{os.fspath(path)}: {exc}") from None

    def step_seconds(self, active: Integer[np.ndarray, "L"], batch: int) -> float:
        """The duration of one step of ``batch`` rows that activate ``active[l]``
        distinct experts at layer l."""
        active = np.asarray(active)
        return self.seconds(int(active.sum()), batch, active.shape[0])

    def seconds(self, total_active: int, batch: int, num_layers: int) -> float:
        """The same from the active experts summed over the layers:
        t0 + a·total_active + b·num_layers·batch."""
        return self.t0 + self.a * total_active + self.b * num_layers * batch


# ----------------------------------------------------------------------------- requests
@dataclasses.dataclass(frozen=True, eq=False)
class SimRequest:
    """One request to replay: ``counts`` [L, E], its prompt tokens' top-k expert counts
    (what the router sees); ``decode_experts`` [L, D, k], the expert ids each of its D
    decode steps chose (replayed in order, D >= 1); ``domain``, its label or None.
    Arrays are kept as read-only copies."""

    counts: Integer[np.ndarray, "L E"]
    decode_experts: Integer[np.ndarray, "L D k"]
    domain: str | None = None

    def __post_init__(self) -> None:
        counts = np.array(self.counts)
        ids = np.array(self.decode_experts)
        if counts.ndim != 2 or counts.shape[0] < 1 or counts.shape[1] < 1:
            raise ValueError(f"counts must be [L, E] with L, E >= 1, got shape {counts.shape}")
        if not np.issubdtype(counts.dtype, np.integer) or (counts < 0).any():
            raise ValueError(f"counts must be non-negative integer token counts, got dtype "
                             f"{counts.dtype}" + (f", min {counts.min()}" if counts.size else ""))
        if ids.ndim != 3 or ids.shape[2] < 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"decode_experts must be integer expert ids [L, D, k], got dtype "
                             f"{ids.dtype}, shape {ids.shape}")
        num_layers, num_experts = counts.shape
        if ids.shape[0] != num_layers:
            raise ValueError(f"decode_experts has {ids.shape[0]} layers, counts has "
                             f"{num_layers}")
        if ids.shape[1] < 1:
            raise ValueError("decode_experts has D = 0 decode steps; a request to simulate "
                             "needs at least one")
        if ids.min() < 0 or ids.max() >= num_experts:
            bad = ids.min() if ids.min() < 0 else ids.max()
            raise ValueError(f"decode_experts: expert id {bad} outside [0, {num_experts})")
        if self.domain is not None and not isinstance(self.domain, str):
            raise ValueError(f"domain must be a str or None, got {self.domain!r}")
        for name, value in (("counts", counts), ("decode_experts", ids)):
            value.setflags(write=False)
            object.__setattr__(self, name, value)

    @property
    def num_layers(self) -> int:
        return int(self.counts.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.counts.shape[1])

    @property
    def decode_tokens(self) -> int:
        """D: the decode steps the request runs."""
        return int(self.decode_experts.shape[1])


def simulable_indices(trace: traces_lib.Trace) -> Integer[np.ndarray, "n"]:
    """The trace's requests a decoder would serve: those that ran and have at least one
    decode token (a request that generated one token never reaches a decoder)."""
    decode = np.diff(trace.arrays["decode_offsets"])
    ran = trace.arrays["errors"] == ""
    return np.flatnonzero(ran & (decode > 0))


def requests_from_trace(trace: traces_lib.Trace,
                        indices: Sequence[int] | None = None) -> list[SimRequest]:
    """:class:`SimRequest` s of a trace: counts = the request's prefill activation counts
    (:func:`moejax.traces.activation_counts`), decode_experts = its decode tokens' ids,
    domain = its label. ``indices`` picks requests (default :func:`simulable_indices`);
    naming an errored request or one with no decode token is an error."""
    if indices is None:
        chosen = simulable_indices(trace)
    else:
        chosen = np.asarray(indices, np.int64).reshape(-1)
        n = trace.num_requests
        bad = chosen[(chosen < -n) | (chosen >= n)]
        if bad.size:
            raise ValueError(f"indices: request {int(bad[0])} outside a trace of {n}")
        chosen = chosen % n if n else chosen
        usable = set(simulable_indices(trace).tolist())
        for i in chosen.tolist():
            if i not in usable:
                why = ("failed: " + str(trace.arrays["errors"][i])
                       if trace.arrays["errors"][i] else "has no decode token")
                raise ValueError(f"indices: request {i} ({trace.ids[i]!r}) cannot be "
                                 f"simulated, it {why}")
    counts = traces_lib.activation_counts(trace, "prefill")
    ids, domains = trace.arrays["decode_experts"], trace.domains
    return [SimRequest(counts=counts[i], decode_experts=ids[:, trace.span("decode", i)],
                       domain=domains[i]) for i in chosen.tolist()]


def shuffled_signatures(requests: Sequence[SimRequest], seed: int = 0
                        ) -> dict[int, Integer[np.ndarray, "L E"]]:
    """The noise floor's ``signatures_of``: request i is shown the prompt counts of
    request perm[i], perm a random permutation (``np.random.default_rng(seed)``)."""
    perm = np.random.default_rng(seed).permutation(len(requests))
    return {i: requests[int(j)].counts for i, j in enumerate(perm)}


# ----------------------------------------------------------------------------- arrivals
def poisson_arrivals(n: int, rate_per_s: float, seed: int = 0) -> Float[np.ndarray, "n"]:
    """``n`` arrival times (seconds, sorted) of a Poisson process of ``rate_per_s``: the
    cumulative sum of exponential gaps (``np.random.default_rng(seed)``); the first
    arrival comes one gap after 0."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    rate = _check_positive("rate_per_s", rate_per_s)
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, int(n)))


def rate_for_batch(target_batch: float, num_decoders: int, mean_decode_tokens: float,
                   step_seconds: float) -> float:
    """The arrival rate (requests/s) that keeps about ``target_batch`` requests running
    on each of ``num_decoders`` decoders.

    Little's law per decoder: requests in system = arrival rate × time in system. A
    request stays D̄ steps (``mean_decode_tokens``) of ``step_seconds`` each, so one
    decoder holding ``target_batch`` admits target_batch / (D̄ · step) requests/s, and K
    of them rate = K · target_batch / (D̄ · step). ``step_seconds`` should be the step
    time at that batch (e.g. :meth:`CostModel.step_seconds` of a typical union); the
    figure ignores queueing, so near saturation the real batch is larger."""
    target = _check_positive("target_batch", target_batch)
    k = _check_positive_int("num_decoders", num_decoders)
    tokens = _check_positive("mean_decode_tokens", mean_decode_tokens)
    step = _check_positive("step_seconds", step_seconds)
    return k * target / (tokens * step)


# ----------------------------------------------------------------------------- result
@dataclasses.dataclass(frozen=True, eq=False)
class SimResult:
    """What :func:`simulate` measured (R requests, K decoders, S steps, L layers).

    Per request: ``decoder`` [R] (the policy's choice), ``arrival`` [R], ``first_token``
    [R] (the end of its first decode step), ``finish`` [R] (the end of its D-th),
    ``decode_tokens`` [R] (D). Per decoder: ``decoder_steps``, ``decoder_busy_s``,
    ``decoder_tokens`` [K]. Per step, in the order the steps started: ``step_decoder``,
    ``step_start``, ``step_end``, ``step_batch`` [S], ``step_active`` [S, L] (distinct
    experts at each layer), and the requests in step s,
    ``step_requests[step_offsets[s]:step_offsets[s + 1]]``."""

    decoder: np.ndarray
    arrival: np.ndarray
    first_token: np.ndarray
    finish: np.ndarray
    decode_tokens: np.ndarray
    decoder_steps: np.ndarray
    decoder_busy_s: np.ndarray
    decoder_tokens: np.ndarray
    step_decoder: np.ndarray
    step_start: np.ndarray
    step_end: np.ndarray
    step_batch: np.ndarray
    step_active: np.ndarray
    step_requests: np.ndarray
    step_offsets: np.ndarray

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            view = np.asarray(getattr(self, field.name)).view()
            view.setflags(write=False)
            object.__setattr__(self, field.name, view)

    @property
    def num_requests(self) -> int:
        return int(self.decoder.shape[0])

    @property
    def num_decoders(self) -> int:
        return int(self.decoder_steps.shape[0])

    @property
    def tpot(self) -> Float[np.ndarray, "R"]:
        """(finish − arrival) / D per request: queueing at the decoder included."""
        return (self.finish - self.arrival) / self.decode_tokens

    @property
    def tpot_p50(self) -> float:
        return float(np.percentile(self.tpot, 50))

    @property
    def tpot_p99(self) -> float:
        return float(np.percentile(self.tpot, 99))

    @property
    def mean_active_experts(self) -> float:
        """Distinct experts per step per layer, averaged over every step and layer (each
        step weighs the same, whatever its batch)."""
        return float(self.step_active.mean())

    @property
    def load_imbalance(self) -> float:
        """max / mean of the tokens each decoder decoded (1.0: perfectly even)."""
        return float(self.decoder_tokens.max() / self.decoder_tokens.mean())

    @property
    def makespan_s(self) -> float:
        """From the first arrival to the last finish."""
        return float(self.finish.max() - self.arrival.min())

    @property
    def throughput_tokens_per_s(self) -> float:
        """Decode tokens of every request over :attr:`makespan_s` (inf if it is 0)."""
        span = self.makespan_s
        total = float(self.decode_tokens.sum())
        return total / span if span > 0 else math.inf

    def step_rows(self, step: int) -> Integer[np.ndarray, "B"]:
        """The requests decoded in step ``step``."""
        return self.step_requests[self.step_offsets[step]:self.step_offsets[step + 1]]


# ----------------------------------------------------------------------------- simulate
def _check_requests(requests: Sequence[SimRequest]) -> tuple[int, int, int]:
    if len(requests) < 1:
        raise ValueError("requests: need at least one request to simulate")
    first = requests[0]
    if not isinstance(first, SimRequest):
        raise ValueError(f"requests[0]: expected a SimRequest, got {type(first).__name__}")
    shape = (first.num_layers, first.num_experts, first.decode_experts.shape[2])
    for i, req in enumerate(requests):
        if not isinstance(req, SimRequest):
            raise ValueError(f"requests[{i}]: expected a SimRequest, got {type(req).__name__}")
        got = (req.num_layers, req.num_experts, req.decode_experts.shape[2])
        if got != shape:
            raise ValueError(f"requests[{i}]: {got[0]} layers, {got[1]} experts, top-{got[2]}; "
                             f"requests[0] has {shape[0]} layers, {shape[1]} experts, "
                             f"top-{shape[2]} (every request must come from one model)")
    return shape


def _check_arrivals(arrival_times: Any, n: int) -> np.ndarray:
    times = np.asarray(arrival_times, np.float64)
    if times.shape != (n,):
        raise ValueError(f"arrival_times: shape {times.shape}, expected ({n},): one per request")
    if not np.isfinite(times).all():
        raise ValueError("arrival_times: holds a NaN or an infinity")
    drops = np.flatnonzero(np.diff(times) < 0)
    if drops.size:
        i = int(drops[0])
        raise ValueError(f"arrival_times must be sorted: [{i}] = {times[i]} > [{i + 1}] = "
                         f"{times[i + 1]}")
    return times


def _check_signatures(signatures_of: Mapping[int, Any] | None, n: int,
                      shape: tuple[int, int]) -> dict[int, np.ndarray]:
    if signatures_of is None:
        return {}
    if not isinstance(signatures_of, Mapping):
        raise ValueError(f"signatures_of must map request index -> counts [L, E], got "
                         f"{type(signatures_of).__name__}")
    shown = {}
    for key, counts in signatures_of.items():
        if isinstance(key, bool) or not isinstance(key, (int, np.integer)) or not 0 <= key < n:
            raise ValueError(f"signatures_of: key {key!r} is not a request index in [0, {n})")
        counts = np.asarray(counts)
        if counts.shape != shape:
            raise ValueError(f"signatures_of[{key}]: shape {counts.shape}, expected {shape} "
                             f"(L, E)")
        shown[int(key)] = counts
    return shown


# The order of an arrival among the events of one instant: below every decoder index, the
# order of a decoder's boundary. So at one instant every arrival is routed first (in
# arrival order: push order), then boundaries run, lowest decoder index first (module
# docstring's tie rule). A separate leave event (release modes other than at_boundary)
# has the order _ARRIVAL - num_decoders + decoder index: below every arrival, lowest
# decoder index first.
_ARRIVAL = -1


class _Replay:
    """One :func:`simulate` run (inputs already checked): its state, and its two events
    as methods, :meth:`arrive` (a request reaches the hand-off and is routed) and
    :meth:`boundary` (a decoder's step ends, or an idle decoder wakes), replayed in time
    order by :meth:`run` from one :class:`moejax.events.EventQueue`; with a ``release``
    mode other than at_boundary, :meth:`leave` (the step's finished requests leave) is an
    event of its own, before the instant's arrivals."""

    def __init__(self, requests: Sequence[SimRequest], arrivals: Float[np.ndarray, "R"],
                 policy: Policy, *, num_decoders: int, cost: CostModel, max_batch_size: int,
                 shown: Mapping[int, np.ndarray], release: str = "at_boundary") -> None:
        self.requests, self.arrivals, self.policy = requests, arrivals, policy
        self.k, self.cost, self.max_batch, self.shown = num_decoders, cost, max_batch_size, shown
        self.release = release
        # Steps a finished request still holds its row for (step_late: one, without a row).
        self.held = int(release == "step_late")
        self.num_layers, self.num_experts = requests[0].num_layers, requests[0].num_experts
        n, k = len(requests), num_decoders

        # Every decode token's expert ids as flat (layer, expert) cells, [tokens, L·k], in
        # request order: a step's union is one scatter into a boolean [L·E] mask.
        self.decode = np.array([req.decode_tokens for req in requests], np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.decode)[:-1]])
        ids = np.concatenate([req.decode_experts for req in requests], axis=1)   # [L, N, k]
        cells = (ids.transpose(1, 0, 2).astype(np.int64)
                 + (np.arange(self.num_layers, dtype=np.int64) * self.num_experts)[None, :, None])
        self.cells = cells.reshape(cells.shape[0], -1)

        self.chosen = np.full(n, -1, np.int64)
        self.first_token = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        self.in_flight = np.zeros(k, np.int64)
        self.waiting: list[collections.deque[int]] = [collections.deque() for _ in range(k)]
        # Per decoder, its running requests, the row in ``cells`` of each one's next decode
        # token and its steps left (decode tokens, + held); None while idle (no step, no
        # wake-up due).
        self.running: list[tuple[np.ndarray, np.ndarray, np.ndarray] | None] = [None] * k
        self.empty = np.zeros(0, np.int64)
        self.records: list[tuple] = []          # per step: d, start, end, seconds, rows, active
        # Arrivals (payload: request index, order _ARRIVAL) and decoder boundaries
        # (payload and order: the decoder index); a decoder has at most one pending.
        self.events: EventQueue[int] = EventQueue()

    def run(self) -> None:
        """Every arrival, then every boundary they cause, in time order (tie rule: the
        module docstring, by :data:`_ARRIVAL`)."""
        for i, t in enumerate(self.arrivals.tolist()):
            self.events.push(t, _ARRIVAL, i)
        while self.events:
            t, order, index = self.events.pop()
            if order == _ARRIVAL:
                self.arrive(t, index)
            elif order < _ARRIVAL:
                self.leave(t, index)
            else:
                self.boundary(t, index)

    def arrive(self, t: float, i: int) -> None:
        """Request ``i`` reaches the hand-off at ``t``: routed once, queued at its decoder;
        an idle decoder wakes at this instant."""
        k, policy, requests = self.k, self.policy, self.requests
        counts = self.shown.get(i, requests[i].counts)
        d = policy.choose(HandOff(counts=counts, domain=requests[i].domain),
                          tuple(self.in_flight.tolist()))
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or not 0 <= d < k:
            raise ValueError(f"policy {policy.name!r} chose decoder {d!r} for request {i}, "
                             f"outside [0, {k})")
        d = int(d)
        self.chosen[i] = d
        self.in_flight[d] += 1
        self.waiting[d].append(i)
        if self.running[d] is None:             # idle: wake at this instant
            self.running[d] = (self.empty, self.empty, self.empty)
            self.events.push(t, d, d)

    def leave(self, t: float, d: int) -> None:
        """Decoder ``d``'s step ended at ``t``: its rows move one token on, and requests
        with no step left leave (a request's ``finish`` is the end of its last decode
        step, which under step_late is one step before it leaves)."""
        rows, position, left = self.running[d]
        if not rows.size:
            return
        computed = left > self.held
        position, left = position + computed, left - 1
        self.finish[rows[computed & (left == self.held)]] = t
        done = left == 0
        if done.any():
            self.in_flight[d] -= int(np.count_nonzero(done))
            keep = ~done
            rows, position, left = rows[keep], position[keep], left[keep]
        self.running[d] = (rows, position, left)

    def boundary(self, t: float, d: int) -> None:
        """Decoder ``d``'s step boundary at ``t``: finished requests leave (here, in
        at_boundary mode; else their leave event has run), waiting ones join (FIFO) up to
        the batch limit, and the next step starts (or ``d`` goes idle)."""
        if self.release == "at_boundary":
            self.leave(t, d)
        rows, position, left = self.running[d]
        room = self.max_batch - rows.size
        joining = self.empty
        if room > 0 and self.waiting[d]:
            queue = self.waiting[d]
            joining = np.array([queue.popleft() for _ in range(min(room, len(queue)))], np.int64)
            rows = np.concatenate([rows, joining])
            position = np.concatenate([position, self.offsets[joining]])
            left = np.concatenate([left, self.decode[joining] + self.held])
        if not rows.size:
            self.running[d] = None
            return
        computing = left > self.held            # the rest hold their rows, running none
        num_layers, num_experts = self.num_layers, self.num_experts
        mask = np.zeros(num_layers * num_experts, bool)
        mask[self.cells[position[computing]].reshape(-1)] = True
        batch = int(np.count_nonzero(computing))
        seconds = self.cost.seconds(int(np.count_nonzero(mask)), batch, num_layers)
        end = t + seconds
        self.first_token[joining] = end
        self.records.append((d, t, end, seconds, rows[computing],
                             np.add.reduce(mask.reshape(num_layers, num_experts), axis=1)))
        self.running[d] = (rows, position, left)
        if self.release != "at_boundary":
            self.events.push(end, _ARRIVAL - self.k + d, d)
        self.events.push(end, d, d)


def simulate(requests: Sequence[SimRequest],
             arrival_times: Float[np.ndarray, "R"] | Sequence[float],
             policy: Policy, *, num_decoders: int, cost: CostModel, max_batch_size: int,
             signatures_of: Mapping[int, Integer[np.ndarray, "L E"]] | None = None,
             release: str = "at_boundary") -> SimResult:
    """Replay ``requests`` arriving at ``arrival_times`` (sorted, seconds) on
    ``num_decoders`` continuous-batching decoders of at most ``max_batch_size`` running
    requests, each routed once by ``policy`` (module docstring for the model and the
    tie rule). ``signatures_of`` maps a request index to the counts the router is shown
    instead of the request's own (the noise floor: signatures shuffled across requests).
    ``release`` (:data:`RELEASE_MODES`) says when a finished request leaves its decoder:
    at its step boundary (the default model), or as the real pipeline's unpipelined
    ("before_arrivals") or pipelined ("step_late") decoders do (module docstring).
    Deterministic given the inputs and the policy's state."""
    if release not in RELEASE_MODES:
        raise ValueError(f"release must be one of {RELEASE_MODES}, got {release!r}")
    num_layers, num_experts, _ = _check_requests(requests)
    n = len(requests)
    arrivals = _check_arrivals(arrival_times, n)
    k = _check_positive_int("num_decoders", num_decoders)
    max_batch = _check_positive_int("max_batch_size", max_batch_size)
    if not isinstance(cost, CostModel):
        raise ValueError(f"cost must be a CostModel, got {type(cost).__name__}")
    if not isinstance(policy, Policy):
        raise ValueError(f"policy must be a moejax.eldr.policies.Policy, got "
                         f"{type(policy).__name__}")
    if policy.num_decoders != k:
        raise ValueError(f"policy {policy.name!r} routes to {policy.num_decoders} decoders, "
                         f"num_decoders is {k}")
    shown = _check_signatures(signatures_of, n, (num_layers, num_experts))

    replay = _Replay(requests, arrivals, policy, num_decoders=k, cost=cost,
                     max_batch_size=max_batch, shown=shown, release=release)
    replay.run()
    decode, records = replay.decode, replay.records
    chosen, first_token, finish = replay.chosen, replay.first_token, replay.finish

    columns = list(zip(*records))
    step_decoder = np.array(columns[0], np.int64)
    durations = np.array(columns[3], np.float64)
    step_batch = np.array([rows.size for rows in columns[4]], np.int64)
    return SimResult(
        decoder=chosen, arrival=arrivals, first_token=first_token, finish=finish,
        decode_tokens=decode,
        decoder_steps=np.bincount(step_decoder, minlength=k),
        decoder_busy_s=np.bincount(step_decoder, weights=durations, minlength=k),
        decoder_tokens=np.bincount(step_decoder, weights=step_batch, minlength=k)
        .astype(np.int64),
        step_decoder=step_decoder, step_start=np.array(columns[1], np.float64),
        step_end=np.array(columns[2], np.float64), step_batch=step_batch,
        step_active=np.array(columns[5], np.int64).reshape(-1, num_layers),
        step_requests=np.concatenate(columns[4]),
        step_offsets=np.concatenate([[0], np.cumsum(step_batch)]).astype(np.int64))
