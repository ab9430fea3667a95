"""Request router: which data-parallel engine runs each prefill request.

:class:`PrefixAwareRouter` is seed Algorithm 1 (§7, App. A/B; DESIGN.md "One request, end to
end", step 3). Per engine g it keeps a shadow of the engine's prefix cache — the *committed*
blocks (KV resident on g) and the *pending* blocks (promised by requests routed to g but not yet
run) — and a work counter W_g in FLOPs. Each request, in FIFO order:

1. **F3 saturation** — candidates are the engines with W_g < Θ;
2. **F1 prefix match** — the longest block-level prefix match over committed ∪ pending, ties to
   the smallest W_g, then the lowest engine index; no match → smallest W_g;
3. **F2 true cost** — ``ΔW = op.flops(cfg, cached=c)`` (seed Eq. (2), ``moejax.ops``) where c
   is the matched blocks × block size, so an engine that already holds (or will hold) the prefix
   is charged only for the rest; W_g += ΔW and the request's uncached prefix blocks become
   pending on g.

Requests are the prefill ops themselves (:class:`moejax.ops.PrefillOp`): the router reads
their ``prefix_len``, their ``block_hashes`` (computed once per op; the engine's prefix cache
names the blocks it stores with the same digests) and their cost.

A popular prefix keeps landing on its engine until that engine saturates; after that the same
rule sends it to the next-best match, whose pending table then attracts the rest (spill, with no
replication policy).

Engines talk back through ONE in-order channel, :attr:`Router.channel` (a
``queue.SimpleQueue``; engines ``put`` events from any thread). ``route`` drains it before it
routes, in arrival order; :meth:`Router.drain` / :meth:`Router.on_event` apply events now.
Events: :class:`BlocksStored` (pending → committed), :class:`BlocksEvicted` (forget the blocks,
committed or pending — an engine in KV-cache-free mode reports its batch's blocks as evicted
after running it), :class:`FlopsExecuted` (W_g decays by the FLOPs run, never below 0).

Rounds (where the seed is silent on the API). The seed's round ends when every engine is
saturated or the queue is empty. ``route`` never refuses a request: each call starts a round
(the saturation test is exactly W_g < Θ), and when every engine is saturated mid-call a new
round begins in which every engine gets a fresh Θ of budget on top of its outstanding work
(W_g − base_g < Θ, base_g = W_g at the round start). So within any round an engine receives
at most Θ + (the largest single request) of work, and the next round queues behind it — the
engine's next batch. Executed FLOPs drain the oldest rounds first (base_g decays too). If every
engine is already saturated when a call starts (its earlier work not yet executed), the call's
first request opens round 1 at once. An engine with no work in the current round always accepts
one request, so Θ = 0 still routes (one request per engine per round).

Matching is block aligned and never credits the block that holds the last token: the engine
must run at least that token to produce logits (vLLM caps prefix hits the same way), so
c ≤ ⌊min(p, n−1)/b⌋·b. Since hashes are chained, an engine's match is found by walking the
request's hashes until the first miss; engines that lack the first block (or the block that
would beat the best match so far) are rejected with one set lookup, and a run already known to
be whole (see :class:`Router`) is recognised with one lookup.

Accounting: ``route`` returns the engine per request; :meth:`Router.assign` (which ``route``
calls) returns a :class:`RoutingReport` — per request the engine, ΔW charged, prefix tokens
credited and round; per engine the ΔW assigned — kept as :attr:`Router.last_report`.
``op.flops(cfg)`` is the cost with no credit, for executed-vs-ideal comparisons.

Baselines with the same interface (decisions only; they keep the same shadow tables so their
reports show the prefix credit the engines' caches would give them): :class:`RoundRobinRouter`,
:class:`LeastTokensRouter` (fewest outstanding prompt tokens, vLLM-style), :class:`RandomRouter`,
and PrefillOnly's shortest-prefill-first scheduler (:class:`ShortestPrefillFirstRouter`, whose
report carries the schedule order). Decisions are deterministic for a fixed input
(RandomRouter: for a fixed seed).
"""

from __future__ import annotations

import abc
import dataclasses
import math
import operator
import queue
import random
from itertools import compress, repeat
from typing import Any, ClassVar, Hashable, Iterable, NamedTuple, Sequence

import numpy as np

from moejax.config import ModelConfig
from moejax.ops import PrefillOp
from moejax.prefix_hash import BLOCK_SIZE

ROUTER_NAMES = ("prefix", "round_robin", "least_tokens", "random", "prefill_only")


# ---------------------------------------------------------------------------- events
@dataclasses.dataclass(frozen=True)
class BlocksStored:
    """Engine ``engine`` now holds these blocks' KV (its cache stored them)."""

    engine: int
    hashes: Sequence[bytes]


@dataclasses.dataclass(frozen=True)
class BlocksEvicted:
    """Engine ``engine`` no longer holds these blocks (evicted, or never stored)."""

    engine: int
    hashes: Sequence[bytes]


@dataclasses.dataclass(frozen=True)
class FlopsExecuted:
    """Engine ``engine`` ran ``flops`` useful FLOPs (the FLOP model of ``moejax.config``).

    ``tokens``: prompt tokens those FLOPs covered; only :class:`LeastTokensRouter` reads it
    (0 = not reported: it then decays its token count in proportion to the FLOPs)."""

    engine: int
    flops: float
    tokens: int = 0

    def __post_init__(self) -> None:
        if not self.flops >= 0:
            raise ValueError(f"FlopsExecuted.flops must be >= 0, got {self.flops!r}")
        if self.tokens < 0:
            raise ValueError(f"FlopsExecuted.tokens must be >= 0, got {self.tokens!r}")


Event = BlocksStored | BlocksEvicted | FlopsExecuted


def report_run(router: "Router", engine: int, ops: Sequence[PrefillOp], costs: Sequence[int],
               stored: Sequence[bytes], evicted: Sequence[bytes], kept: bool) -> None:
    """The events of one routing target after it ran ``ops`` (charged ``costs``), put on
    ``router``'s channel in order: the blocks its cache stored and evicted, then the
    FLOPs. ``kept``: whether its cache keeps blocks across runs; if not (no cache, or
    KV-cache-free), the prefix blocks the router expects from these ops never arrive
    and are reported evicted (the ops' memoized digests: the router hashed them)."""
    channel = router.channel
    if evicted:
        channel.put(BlocksEvicted(engine=engine, hashes=list(evicted)))
    if stored:
        channel.put(BlocksStored(engine=engine, hashes=list(stored)))
    if not kept:
        size = router.block_size
        promised = [h for op in ops for h in op.block_hashes(size)[:op.prefix_len // size]]
        if promised:
            channel.put(BlocksEvicted(engine=engine, hashes=promised))
    tokens = sum(len(op.token_ids) for op in ops)
    channel.put(FlopsExecuted(engine=engine, flops=sum(costs), tokens=tokens))


# ---------------------------------------------------------------------------- reports
class Assignment(NamedTuple):
    """Where one request went and what it was charged.

    ``key``: the op's key. ``cost``: ΔW in FLOPs after the prefix credit. ``cached_tokens``:
    the credit c (block aligned). ``round``: the round of this ``route`` call it belongs to
    (0-based)."""

    key: Hashable
    engine: int
    cost: int
    cached_tokens: int
    round: int


@dataclasses.dataclass(frozen=True)
class RoutingReport:
    """Accounting of one ``route`` call (also kept as :attr:`Router.last_report`)."""

    assignments: tuple[Assignment, ...]
    engine_flops: tuple[int, ...]     # ΔW assigned to each engine by this call
    num_rounds: int
    # The order the router scheduled the requests in (indices into the call); () = FIFO.
    order: tuple[int, ...] = ()

    def schedule(self) -> list[int]:
        """Request indices in the order they were scheduled."""
        return list(self.order) if self.order else list(range(len(self.assignments)))

    @property
    def engines(self) -> list[int]:
        return [a.engine for a in self.assignments]

    @property
    def total_flops(self) -> int:
        """FLOPs the engines will execute for this call (after prefix credits)."""
        return sum(self.engine_flops)

    @property
    def cached_tokens(self) -> int:
        return sum(a.cached_tokens for a in self.assignments)

    def round_flops(self, round_index: int) -> tuple[int, ...]:
        """ΔW assigned to each engine within one round."""
        totals = [0] * len(self.engine_flops)
        for a in self.assignments:
            if a.round == round_index:
                totals[a.engine] += a.cost
        return tuple(totals)


# ---------------------------------------------------------------------------- routers
class Router(abc.ABC):
    """Common state: shadow block tables, FLOP work counters, the event channel.

    Per engine, one set ``held`` = committed ∪ pending (what matching reads) and one set
    ``pending`` (committed = held − pending), so every table update is a C-level set
    operation over a whole event or request rather than a Python loop per block. A third set,
    ``runs``, remembers hashes known to end a contiguous run from the root; tables only grow
    between evictions, so it stays exact until the engine's next ``BlocksEvicted`` clears it,
    and a sibling whose prefix is already known costs one lookup instead of a walk.
    """

    name: ClassVar[str] = "base"

    def __init__(self, cfg: ModelConfig, num_engines: int, block_size: int = BLOCK_SIZE) -> None:
        if not isinstance(num_engines, int) or num_engines < 1:
            raise ValueError(f"num_engines must be a positive integer, got {num_engines!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.cfg = cfg
        self.num_engines = num_engines
        self.block_size = block_size
        self.channel: queue.SimpleQueue = queue.SimpleQueue()
        self.last_report: RoutingReport | None = None
        self._work: list[int | float] = [0] * num_engines        # W_g
        self._held: list[set[bytes]] = [set() for _ in range(num_engines)]
        self._pending: list[set[bytes]] = [set() for _ in range(num_engines)]
        self._runs: list[set[bytes]] = [set() for _ in range(num_engines)]
        self._round = 0
        self._unavailable: frozenset[int] = frozenset()
        # False: the engines keep and share no prefix (no pool, no prompt sharing), so no
        # match is credited and nothing promised: every op is priced at its full FLOPs.
        self.shares_prefixes = True

    # ------------------------------------------------------------------ availability
    @property
    def unavailable(self) -> frozenset[int]:
        """Engines that take no work now (e.g. upstreams of ``moejax router`` that are not
        serving): never chosen. Empty by default, and then every decision is the plain
        rule's."""
        return self._unavailable

    def set_unavailable(self, engines: Iterable[int]) -> None:
        """Mark ``engines`` as taking no work (the others as taking it); at least one
        engine must stay available."""
        down = frozenset(self._check_engine(g) for g in engines)
        if len(down) >= self.num_engines:
            raise ValueError("set_unavailable: at least one engine must stay available")
        self._unavailable = down
        self._on_availability()

    def available(self) -> list[int]:
        """The engines that take work, ascending."""
        return [g for g in range(self.num_engines) if g not in self._unavailable]

    # ------------------------------------------------------------------ public
    def route(self, requests: Sequence[PrefillOp]) -> list[int]:
        """Engine index per request, in order (details in :attr:`last_report`)."""
        return self.assign(requests).engines

    def assign(self, requests: Sequence[PrefillOp]) -> RoutingReport:
        """Drain the event channel, then route ``requests`` in FIFO order."""
        self._validate(requests)
        self.drain()
        self._begin_call()
        assignments = [self._route_one(request) for request in requests]
        engine_flops = [0] * self.num_engines
        for a in assignments:          # summed from the costs: exact even when W_g is a float
            engine_flops[a.engine] += a.cost
        report = RoutingReport(assignments=tuple(assignments), engine_flops=tuple(engine_flops),
                               num_rounds=self._round + 1 if assignments else 0)
        self.last_report = report
        return report

    def drain(self) -> int:
        """Apply every event waiting in :attr:`channel`, in order; returns how many."""
        count = 0
        while True:
            try:
                event = self.channel.get_nowait()
            except queue.Empty:
                return count
            self.on_event(event)
            count += 1

    def drain_events(self, events: Iterable[Event]) -> None:
        """Apply ``events`` now, in order (for callers that batch events themselves)."""
        for event in events:
            self.on_event(event)

    def on_event(self, event: Event) -> None:
        """Apply one engine event to the shadow state."""
        engine = self._check_engine(event.engine)
        if isinstance(event, (BlocksStored, BlocksEvicted)):
            hashes = event.hashes
            if not isinstance(hashes, (tuple, list, set, frozenset)):
                hashes = tuple(hashes)         # read twice below
            if isinstance(event, BlocksStored):
                self._store(engine, hashes)
            else:
                self._evict(engine, hashes)
        elif isinstance(event, FlopsExecuted):
            before = self._work[engine]
            self._work[engine] = max(0, before - event.flops)
            self._on_executed(engine, event, before)
        else:
            raise TypeError(f"unknown router event {event!r}")

    def load(self, engine: int) -> int | float:
        """W_g: outstanding work of ``engine`` in FLOPs (assigned minus executed)."""
        return self._work[self._check_engine(engine)]

    def loads(self) -> list[int | float]:
        return list(self._work)

    def committed_blocks(self, engine: int) -> frozenset[bytes]:
        """Blocks ``engine`` reported stored and not evicted."""
        engine = self._check_engine(engine)
        return frozenset(self._held[engine] - self._pending[engine])

    def pending_blocks(self, engine: int) -> frozenset[bytes]:
        """Blocks promised to ``engine`` by routed requests, not yet reported stored."""
        return frozenset(self._pending[self._check_engine(engine)])

    def num_blocks(self, engine: int) -> int:
        """|committed ∪ pending| of ``engine``."""
        return len(self._held[self._check_engine(engine)])

    # ------------------------------------------------------------------ subclass hooks
    @abc.abstractmethod
    def _choose(self, op: PrefillOp, hashes: tuple[bytes, ...],
                limit: int) -> tuple[int, int]:
        """(engine, matched blocks on it) for ``op``; ``limit`` caps the match."""

    def _begin_call(self) -> None:
        self._round = 0

    def _on_executed(self, engine: int, event: FlopsExecuted, work_before: int | float) -> None:
        """Extra decay after W_g went down (subclasses with more counters)."""

    def _on_availability(self) -> None:
        """The set of unavailable engines changed."""

    def _on_assigned(self, engine: int, op: PrefillOp) -> None:
        """Extra bookkeeping after ``op`` went to ``engine``."""

    # ------------------------------------------------------------------ internals
    def _route_one(self, op: PrefillOp) -> Assignment:
        # The op's own digests, computed once: its engine's prefix cache reads the same ones.
        # Only the prefix's blocks ([0, prefix // b)) are ever matched or promised.
        hashes = op.block_hashes(self.block_size)
        prefix = op.prefix_len
        # The block holding the last token is never credited (it must run for the logits).
        limit = min(prefix, len(op.token_ids) - 1) // self.block_size
        engine, matched = self._choose(op, hashes, limit)
        cached = matched * self.block_size
        cost = op.flops(self.cfg, cached)
        self._work[engine] += cost
        self._promise(engine, hashes, matched, prefix // self.block_size)
        self._on_assigned(engine, op)
        return Assignment(op.key, engine, cost, cached, self._round)

    def _match(self, engine: int, hashes: tuple[bytes, ...], limit: int) -> int:
        """Contiguous blocks of ``hashes[:limit]`` that ``engine`` holds, from the start."""
        if not limit or not self.shares_prefixes:
            return 0
        last, runs = hashes[limit - 1], self._runs[engine]
        if last in runs:
            return limit
        table = self._held[engine]
        # Full hits (siblings, repeated prompts) are the common case: test them in one C-level
        # pass. Lookups in a big table miss the CPU cache, so bytecode is what we can save.
        if last in table and table.issuperset(hashes[:limit]):
            runs.add(last)
            return limit
        matched = 0
        for h in hashes[:limit]:
            if h not in table:
                break
            matched += 1
        if matched:
            runs.add(hashes[matched - 1])
        return matched

    def _promise(self, engine: int, hashes: tuple[bytes, ...], start: int, stop: int) -> None:
        """Add the request's uncached prefix blocks to ``engine``'s pending table."""
        if start >= stop or not self.shares_prefixes:
            return
        fresh = set(hashes[start:stop])
        held = self._held[engine]
        fresh -= held              # a block past the first miss may already be held
        held |= fresh
        self._pending[engine] |= fresh
        self._runs[engine].add(hashes[stop - 1])   # blocks [0, start) matched: a full run now

    def _store(self, engine: int, hashes: Iterable[bytes]) -> None:
        # Blocks stored without being promised (warm-up, another router) become committed too.
        self._pending[engine].difference_update(hashes)
        self._held[engine].update(hashes)

    def _evict(self, engine: int, hashes: Iterable[bytes]) -> None:
        self._held[engine].difference_update(hashes)
        self._pending[engine].difference_update(hashes)
        self._runs[engine].clear()     # a removed block may break any known run

    def _least_loaded(self, engines: Sequence[int]) -> int:
        """Engine with the smallest W_g among ``engines`` (ascending; ties: lowest index)."""
        return min(engines, key=self._work.__getitem__)

    def _check_engine(self, engine: int) -> int:
        if not isinstance(engine, (int, np.integer)) or not 0 <= engine < self.num_engines:
            raise ValueError(f"engine index {engine!r} out of range [0, {self.num_engines})")
        return int(engine)

    def _validate(self, requests: Sequence[PrefillOp]) -> None:
        """Refuse the whole call before touching any state."""
        for op in requests:
            if not isinstance(op, PrefillOp):
                raise TypeError(f"route() takes PrefillOp objects, got {type(op).__name__}")
            if op.position_offset:
                raise ValueError(f"op {op.key!r} is a continuation (position_offset "
                                 f"{op.position_offset}): route the op it continues")


class PrefixAwareRouter(Router):
    """Seed Algorithm 1: saturation (F3) → longest prefix match (F1) → true-FLOP cost (F2).

    ``theta``: Θ in FLOPs (``moejax.calibrate.Calibration.theta``; ``math.inf`` = never
    saturate), one for every engine or one per engine. ``rates``: each engine's FLOP rate
    (any unit, e.g. R of its calibration; default: all equal). Heterogeneous engines (a
    resident device beside an offload one) each saturate at their own Θ, and load is
    compared as time to drain, W_g / rate_g: the least-loaded engine and the tie-break
    of equal matches are the one that finishes its queued work first. See the module
    docstring for rounds and the match cap.
    """

    name = "prefix"

    def __init__(self, cfg: ModelConfig, num_engines: int, theta: float | Sequence[float],
                 block_size: int = BLOCK_SIZE, rates: Sequence[float] | None = None) -> None:
        super().__init__(cfg, num_engines, block_size)
        self.thetas = _per_engine_thetas(theta, num_engines)
        self.rates = _check_rates(rates, num_engines)
        self._base: list[int | float] = [0] * num_engines     # W_g at the current round start
        self._open: list[int] = []                  # unsaturated engines, ascending
        self._open_tables: list[set[bytes]] = []    # their held tables, in the same order
        self._set_open(range(num_engines))

    @classmethod
    def from_calibration(cls, cfg: ModelConfig, num_engines: int, calibration: Any,
                         block_size: int = BLOCK_SIZE) -> "PrefixAwareRouter":
        """Θ from a ``moejax.calibrate.Calibration`` (anything with a ``theta``), or Θ and
        the FLOP rate of each engine from one calibration per engine (rates where every
        one measured R, else equal)."""
        if not isinstance(calibration, (list, tuple)):
            return cls(cfg, num_engines, calibration.theta, block_size)
        if len(calibration) != num_engines:
            raise ValueError(f"{len(calibration)} calibrations for {num_engines} engines")
        rates = [c.rate for c in calibration]
        return cls(cfg, num_engines, [c.theta for c in calibration], block_size,
                   rates=None if any(r is None for r in rates) else rates)

    @property
    def theta(self) -> float | tuple[float, ...]:
        """Θ: one number when every engine has the same, else one per engine."""
        return self.thetas[0] if len(set(self.thetas)) == 1 else tuple(self.thetas)

    def set_theta(self, theta: float | Sequence[float]) -> None:
        """Install a new Θ (e.g. delivered after the engines' calibration run)."""
        self.thetas = _per_engine_thetas(theta, self.num_engines)
        self._refresh_open()

    def drain_time(self, engine: int) -> float:
        """W_g / rate_g: how long engine ``engine``'s queued work takes, in the rates' unit."""
        return self._work[self._check_engine(engine)] / self.rates[engine]

    def saturated(self, engine: int) -> bool:
        """Whether ``engine`` takes no more work in the current round."""
        return self._check_engine(engine) not in self._open

    # ------------------------------------------------------------------ hooks
    def _begin_call(self) -> None:
        super()._begin_call()
        self._base = [0] * self.num_engines    # each call starts a round: the test is W_g < Θ
        self._refresh_open()

    def _choose(self, op: PrefillOp, hashes: tuple[bytes, ...],
                limit: int) -> tuple[int, int]:
        if not self._open:
            self._new_round()
        candidates = self._open
        if not limit:
            return self._least_loaded(candidates), 0
        # Engines holding the first block, found in C (most engines miss it; 64 probes in
        # bytecode would cost more than the rest of the decision).
        holders = compress(candidates, map(operator.contains, self._open_tables,
                                           repeat(hashes[0])))
        held, rates = self._held, self.rates
        work = [w / r for w, r in zip(self._work, rates)]       # drain times
        best, best_len = -1, 0
        for g in holders:
            table = held[g]
            if best_len:
                # g wins only with a longer match, or an equal one and less work. Chained
                # hashes: matching block i requires every block before it, so one lookup of
                # the block g would need rejects it without a walk.
                needed = best_len if work[g] >= work[best] else best_len - 1
                if needed >= limit or hashes[needed] not in table:
                    continue
            length = self._match(g, hashes, limit)
            # Ascending engine order: a later engine wins a tie only with strictly less
            # drain time.
            if length > best_len or (length == best_len and work[g] < work[best]):
                best, best_len = g, length
        if best < 0:
            return self._least_loaded(candidates), 0
        return best, best_len

    def _least_loaded(self, engines: Sequence[int]) -> int:
        """The engine of ``engines`` that drains its queued work first (ties: lowest)."""
        return min(engines, key=lambda g: self._work[g] / self.rates[g])

    def _on_assigned(self, engine: int, op: PrefillOp) -> None:
        if not self._is_open(engine):
            self._set_open(g for g in self._open if g != engine)

    def _on_executed(self, engine: int, event: FlopsExecuted, work_before: int | float) -> None:
        # Executed work comes off the oldest rounds first.
        self._base[engine] = max(0, self._base[engine] - event.flops)
        if self._is_open(engine) != (engine in self._open):
            self._refresh_open()

    # ------------------------------------------------------------------ rounds
    def _is_open(self, engine: int) -> bool:
        round_work = self._work[engine] - self._base[engine]
        return round_work < self.thetas[engine] or round_work <= 0

    def _refresh_open(self) -> None:
        self._set_open(g for g in range(self.num_engines) if self._is_open(g))

    def _on_availability(self) -> None:
        self._refresh_open()

    def _set_open(self, engines: Iterable[int]) -> None:
        # An unavailable engine is absent from every round (F3 never offers it).
        self._open = [g for g in engines if g not in self._unavailable]
        self._open_tables = [self._held[g] for g in self._open]

    def _new_round(self) -> None:
        """Every engine is saturated: open the next round with a fresh Θ for each."""
        self._round += 1
        self._base = list(self._work)
        self._set_open(range(self.num_engines))


class RoundRobinRouter(Router):
    """Engine i mod G for the i-th request routed (the counter persists across calls)."""

    name = "round_robin"

    def __init__(self, cfg: ModelConfig, num_engines: int, block_size: int = BLOCK_SIZE) -> None:
        super().__init__(cfg, num_engines, block_size)
        self._next = 0

    def _choose(self, op: PrefillOp, hashes: tuple[bytes, ...],
                limit: int) -> tuple[int, int]:
        while True:   # the rotation passes over unavailable engines
            engine = self._next
            self._next = (engine + 1) % self.num_engines
            if engine not in self._unavailable:
                return engine, self._match(engine, hashes, limit)


class LeastTokensRouter(Router):
    """Fewest outstanding prompt tokens (all ``num_tokens``, no prefix credit), ties to the
    lowest index. Outstanding tokens decay on :class:`FlopsExecuted`: by ``tokens`` when the
    engine reports it, else by the executed share of W_g."""

    name = "least_tokens"

    def __init__(self, cfg: ModelConfig, num_engines: int, block_size: int = BLOCK_SIZE) -> None:
        super().__init__(cfg, num_engines, block_size)
        self._tokens: list[int | float] = [0] * num_engines

    def outstanding_tokens(self, engine: int) -> int | float:
        return self._tokens[self._check_engine(engine)]

    def _choose(self, op: PrefillOp, hashes: tuple[bytes, ...],
                limit: int) -> tuple[int, int]:
        tokens = self._tokens
        engines = self.available() if self._unavailable else range(self.num_engines)
        engine = min(engines, key=tokens.__getitem__)
        return engine, self._match(engine, hashes, limit)

    def _on_assigned(self, engine: int, op: PrefillOp) -> None:
        self._tokens[engine] += len(op.token_ids)

    def _on_executed(self, engine: int, event: FlopsExecuted, work_before: int | float) -> None:
        if event.tokens:
            self._tokens[engine] = max(0, self._tokens[engine] - event.tokens)
        elif work_before > 0:
            share = min(1.0, event.flops / work_before)
            self._tokens[engine] -= self._tokens[engine] * share


class RandomRouter(Router):
    """Uniformly random engine from a seeded generator (reproducible for a fixed seed)."""

    name = "random"

    def __init__(self, cfg: ModelConfig, num_engines: int, seed: int = 0,
                 block_size: int = BLOCK_SIZE) -> None:
        super().__init__(cfg, num_engines, block_size)
        self._rng = random.Random(seed)

    def _choose(self, op: PrefillOp, hashes: tuple[bytes, ...],
                limit: int) -> tuple[int, int]:
        while True:   # draws of unavailable engines are drawn again
            engine = self._rng.randrange(self.num_engines)
            if engine not in self._unavailable:
                return engine, self._match(engine, hashes, limit)


class ShortestPrefillFirstRouter(Router):
    """PrefillOnly's scheduler as a router policy (the MoE-Prefill paper's baseline):
    shortest prefill first, with continuous prefill-time estimation. Each call's requests
    are scheduled one at a time: every request still waiting is estimated afresh against
    what the engines hold now (its FLOPs after the longest prefix match on any engine,
    pending blocks included, so a request whose prefix an earlier one just promised
    becomes cheap), and the cheapest goes next (ties: arrival order), to the engine of its
    match, else the least loaded. No Θ: PrefillOnly admits by order, not by saturation.
    The report's ``order`` is the schedule, which a pool running ``max_num_seqs``
    requests at a time follows (``moejax.core.engine_pool.EnginePool``)."""

    name = "prefill_only"

    def assign(self, requests: Sequence[PrefillOp]) -> RoutingReport:
        self._validate(requests)
        self.drain()
        self._begin_call()
        waiting = list(range(len(requests)))
        assignments: list[Assignment | None] = [None] * len(requests)
        order = []
        while waiting:
            estimates = [self._estimate(requests[i]) for i in waiting]
            pick = waiting.pop(min(range(len(waiting)), key=estimates.__getitem__))
            assignments[pick] = self._route_one(requests[pick])
            order.append(pick)
        engine_flops = [0] * self.num_engines
        for a in assignments:
            engine_flops[a.engine] += a.cost
        report = RoutingReport(assignments=tuple(assignments), engine_flops=tuple(engine_flops),
                               num_rounds=1 if assignments else 0, order=tuple(order))
        self.last_report = report
        return report

    def _estimate(self, op: PrefillOp) -> int:
        """The op's prefill FLOPs after its best prefix match on any engine now."""
        hashes = op.block_hashes(self.block_size)
        limit = min(op.prefix_len, len(op.token_ids) - 1) // self.block_size
        best = max((self._match(g, hashes, limit) for g in self.available()), default=0)
        return op.flops(self.cfg, best * self.block_size)

    def _choose(self, op: PrefillOp, hashes: tuple[bytes, ...],
                limit: int) -> tuple[int, int]:
        engines = self.available()
        best, best_len = min(engines, key=self._work.__getitem__), 0
        for g in engines:
            length = self._match(g, hashes, limit)
            if length > best_len or (length == best_len and length
                                     and self._work[g] < self._work[best]):
                best, best_len = g, length
        return best, best_len


def make_router(name: str, cfg: ModelConfig, num_engines: int, theta: float = math.inf,
                seed: int = 0, block_size: int = BLOCK_SIZE, *,
                shares_prefixes: bool = True) -> Router:
    """Router by name: "prefix" | "round_robin" | "least_tokens" | "random" |
    "prefill_only".

    ``theta`` is validated for every name but only "prefix" uses it; ``seed`` only "random".
    ``shares_prefixes``: whether the engines reuse a prefix at all (a pool or prompt
    sharing); engines that do not are priced at every op's full FLOPs.
    """
    _check_theta(theta)
    if name == "prefix":
        router: Router = PrefixAwareRouter(cfg, num_engines, theta, block_size)
    elif name == "round_robin":
        router = RoundRobinRouter(cfg, num_engines, block_size)
    elif name == "least_tokens":
        router = LeastTokensRouter(cfg, num_engines, block_size)
    elif name == "random":
        router = RandomRouter(cfg, num_engines, seed, block_size)
    elif name == "prefill_only":
        router = ShortestPrefillFirstRouter(cfg, num_engines, block_size)
    else:
        raise ValueError(f"unknown router {name!r}: choose one of {', '.join(ROUTER_NAMES)}")
    router.shares_prefixes = shares_prefixes
    return router


def _per_engine_thetas(theta: float | Sequence[float], num_engines: int) -> list[float]:
    """Θ for each engine: one number for all, or a sequence of one per engine."""
    if isinstance(theta, (list, tuple, np.ndarray)):
        if len(theta) != num_engines:
            raise ValueError(f"theta: {len(theta)} values for {num_engines} engines")
        return [_check_theta(t) for t in theta]
    return [_check_theta(theta)] * num_engines


def _check_rates(rates: Sequence[float] | None, num_engines: int) -> list[float]:
    """Each engine's FLOP rate (> 0, finite); all 1.0 when not given."""
    if rates is None:
        return [1.0] * num_engines
    if len(rates) != num_engines:
        raise ValueError(f"rates: {len(rates)} values for {num_engines} engines")
    out = []
    for rate in rates:
        if isinstance(rate, bool) or not isinstance(rate, (int, float, np.integer, np.floating)) \
                or not math.isfinite(rate) or rate <= 0:
            raise ValueError(f"rates must be finite numbers > 0, got {rate!r}")
        out.append(float(rate))
    return out


def _check_theta(theta: float) -> float:
    if not isinstance(theta, (int, float, np.integer, np.floating)) or math.isnan(theta) \
            or theta < 0:
        raise ValueError(f"theta must be a number >= 0 (FLOPs), got {theta!r}")
    return float(theta)
