"""What ``moejax router`` knows and decides about its upstreams' work: the model it routes
for, the Router with one engine per upstream, and a model of each upstream's prefix cache.

Why a module of its own: which upstream gets a request is a question of routing state
alone (the Router's loads and promised blocks, the shadow caches), apart from which
upstreams may take work (:mod:`serving.grpc.upstreams`: health, failed calls) and from
forwarding calls and retrying them (:mod:`serving.grpc.router_service`,
:mod:`serving.grpc.router_stream`).

* :func:`load_model` / :func:`model_mismatch` — the router's model (config and tokenizer,
  never weights) and whether an upstream's ``ModelInfo`` is of the same model;
* :class:`ShadowCache` — the LRU model of one upstream's prefix cache;
* :class:`RoutingCore` — the requests' ops (``serving.requests`` with the model's
  tokenizer), the Router and the shadow caches together: :meth:`RoutingCore.route` picks
  upstreams, :meth:`RoutingCore.finish` / :meth:`RoutingCore.abandon` turn an answer or a
  failure into the Router's ``BlocksStored`` / ``BlocksEvicted`` / ``FlopsExecuted``
  events.

Cache contents (the choice made here): the router's own model of what it sent where. Each
upstream's cache is modelled as an LRU of block hashes (``ShadowCache``) bounded by
that upstream's real capacity (``prefix_cache_blocks`` of its ``ModelInfo.info_json``; 0
for a KV-cache-free upstream): blocks that fall out of the model are reported to the
Router as ``BlocksEvicted``, so affinity to prefixes the upstream has long evicted decays.
The model can be wrong (the upstream evicts in its own order, or restarts): that only
costs cache hits, never correctness — every answer is the upstream's. An upstream found
unreachable and back again is presumed restarted: its whole shadow is dropped
(:meth:`RoutingCore.reset`).

Upstreams that take no work now are the Router's own unavailable engines
(``Router.set_unavailable``): never chosen, and with all available every decision is the
plain rule's.

Everything here runs on the router's event loop (one thread): no locks.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from typing import TYPE_CHECKING, Sequence

import numpy as np

from moejax.config import ModelConfig
from moejax.core.router import (Assignment, BlocksEvicted, BlocksStored, FlopsExecuted,
                            make_router)
from moejax.ops import PrefillOp
from serving.grpc import convert, scoring_pb2 as pb
from serving.limits import RequestLimits
from serving.requests import (ClassifierHead, RequestError, TokenizerAdapter,
                              normalize_requests)

if TYPE_CHECKING:
    from serving.grpc.upstreams import UpstreamPool


# ---------------------------------------------------------------------------- the model
# What must agree between the router's model and an upstream's (ModelInfo field, config).
MODEL_FIELDS = (("architecture", "model_type"), ("vocab_size", "vocab_size"),
                ("max_context", "max_context"), ("num_layers", "num_layers"),
                ("num_experts", "num_experts"), ("experts_per_token", "num_experts_per_tok"))


def load_model(model: str) -> tuple[ModelConfig, TokenizerAdapter, str]:
    """(config, tokenizer, name) of a model directory, built-in name or hub id; no weights."""
    from moejax.checkpoint import load_model_config, load_tokenizer
    from moejax.model_dirs import model_display_name, resolve_model_dir

    model_dir, is_demo = resolve_model_dir(model)
    name = model_display_name(model, model_dir, is_demo)
    return (load_model_config(model_dir),
            TokenizerAdapter.from_model_dir(model_dir, load_tokenizer(model_dir)), name)


def model_mismatch(cfg: ModelConfig, info: pb.ModelInfoResponse) -> str | None:
    """Why an upstream's ModelInfo is not of the model ``cfg`` (None: it is)."""
    for field, attr in MODEL_FIELDS:
        theirs, ours = getattr(info, field), getattr(cfg, attr)
        if theirs != ours:
            return f"{field} is {theirs!r} there, {ours!r} here"
    return None


# ---------------------------------------------------------------------------- routing
class ShadowCache:
    """The router's LRU model of one upstream's prefix cache (block hashes)."""

    def __init__(self, capacity: int = 0):
        self.capacity = capacity
        self._blocks: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: bytes) -> bool:
        return block in self._blocks

    def store(self, hashes: Sequence[bytes]) -> tuple[list[bytes], list[bytes]]:
        """Use (or add) ``hashes`` -> (those now held, those evicted to make room)."""
        blocks = self._blocks
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        evicted = self._shrink()
        gone = set(evicted)
        return [h for h in hashes if h not in gone], evicted

    def resize(self, capacity: int) -> list[bytes]:
        self.capacity = capacity
        return self._shrink()

    def clear(self) -> list[bytes]:
        evicted = list(self._blocks)
        self._blocks.clear()
        return evicted

    def _shrink(self) -> list[bytes]:
        evicted = []
        while len(self._blocks) > self.capacity:
            evicted.append(self._blocks.popitem(last=False)[0])
        return evicted


class NoUpstream(Exception):
    """No upstream takes work now."""


@dataclasses.dataclass(eq=False)
class Routed:
    """One request sent to one upstream; ``done`` once its events were fed back."""

    upstream: int
    op: PrefillOp | None
    assignment: Assignment | None
    done: bool = False


def cache_capacity(info: pb.ModelInfoResponse) -> int:
    """Blocks an upstream's prefix cache keeps across calls (0: none, or not reported)."""
    try:
        details = json.loads(info.info_json or "{}")
    except ValueError:
        return 0
    if details.get("kv_cache_free"):
        return 0
    blocks = details.get("prefix_cache_blocks")
    return int(blocks) if isinstance(blocks, (int, float)) and blocks > 0 else 0


class RoutingCore:
    """The Router with one engine per upstream, its shadow caches, and the request ->
    prefill-op preparation (see the module docstring). Not thread-safe: one event loop
    (only :meth:`prepare` and :meth:`prepare_generation`, which touch no state, run on
    worker threads). ``pool``: the upstreams (:class:`serving.grpc.upstreams.UpstreamPool`:
    its size and which of them take work now)."""

    def __init__(self, cfg: ModelConfig, tokenizer: TokenizerAdapter, pool: UpstreamPool,
                 routing: str = "prefix", theta: float = math.inf, seed: int = 0):
        self.cfg, self.tokenizer, self.pool = cfg, tokenizer, pool
        self.router = make_router(routing, cfg, len(pool), theta=theta, seed=seed)
        self.shadows = [ShadowCache() for _ in range(len(pool))]
        self.routed = [0] * len(pool)      # requests routed to each upstream (metrics)
        self.limits = RequestLimits.resolve(cfg.max_context)

    # ------------------------------------------------------------------ preparing
    def prepare(self, message: pb.ScoreRequest, index: int) -> PrefillOp | None:
        """The op that stands for a scoring request (None: invalid; the upstream will say
        why). Pure: runs on any thread."""
        try:
            self.limits.check(convert.limit_view(message), index)
            ops, _, _ = normalize_requests([convert.request_from_proto(message)],
                                           self.tokenizer, vocab_size=self.cfg.vocab_size,
                                           max_context=self.cfg.max_context, start=index,
                                           head=ClassifierHead.of(self.cfg))
        except Exception:  # noqa: BLE001  (invalid: forwarded, the upstream answers it)
            return None
        return ops[0] if ops else None

    def prepare_generation(self, message: pb.GenerateRequest) -> PrefillOp | None:
        """The op of a generation request's prompt (its prefix), or None."""
        try:
            if message.HasField("prompt") == message.HasField("prompt_token_ids"):
                return None
            ids = (self.tokenizer.encode(message.prompt) if message.HasField("prompt")
                   else list(message.prompt_token_ids.ids))
            if not ids or len(ids) > self.cfg.max_context or \
                    not all(0 <= t < self.cfg.vocab_size for t in ids):
                return None
            return PrefillOp(key=("generate", 0), token_ids=np.asarray(ids, np.int32),
                             score_positions=[len(ids) - 1], score_token_ids=[()],
                             full_vocab=True, prefix_len=len(ids))
        except (RequestError, ValueError, TypeError):
            return None

    # ------------------------------------------------------------------ routing
    def route(self, ops: Sequence[PrefillOp | None], *, exclude: Sequence[int] = (),
              generation: bool = False) -> list[Routed]:
        """The upstream of each op, in order, in one Router call (None ops — invalid
        requests — go to the least loaded upstream, uncharged). Raises NoUpstream."""
        available = self.pool.available(generation=generation, exclude=exclude)
        if not available:
            raise NoUpstream()
        self.router.set_unavailable(set(range(len(self.pool))) - set(available))
        valid = [op for op in ops if op is not None]
        assignments = iter(self.router.assign(valid).assignments if valid else ())
        routed = []
        for op in ops:
            if op is None:
                routed.append(Routed(min(available, key=self.router.load), None, None))
            else:
                a = next(assignments)
                routed.append(Routed(a.engine, op, a))
            self.routed[routed[-1].upstream] += 1
        return routed

    def finish(self, routed: Routed, *, stored: bool = True) -> None:
        """The upstream answered: its cache holds the prompt's blocks now (``stored``;
        a generation stores none), and the work charged is done."""
        if routed.done:
            return
        routed.done = True
        if routed.op is None:
            return
        g, hashes = routed.upstream, self._prefix_hashes(routed.op)
        if stored:
            kept, evicted = self.shadows[g].store(hashes)
            if evicted:
                self.router.on_event(BlocksEvicted(g, evicted))
            if kept:
                self.router.on_event(BlocksStored(g, kept))
        else:
            self._release(g, hashes)
        self._executed(routed)

    def abandon(self, routed: Routed) -> None:
        """The call failed or was cancelled: nothing was stored, the charge is dropped."""
        if routed.done:
            return
        routed.done = True
        if routed.op is not None:
            self._release(routed.upstream, self._prefix_hashes(routed.op))
            self._executed(routed)

    def set_capacity(self, index: int, info: pb.ModelInfoResponse) -> None:
        """Bound upstream ``index``'s shadow by the capacity its ModelInfo reports."""
        evicted = self.shadows[index].resize(cache_capacity(info))
        if evicted:
            self.router.on_event(BlocksEvicted(index, evicted))

    def reset(self, index: int) -> None:
        """Forget every block believed cached (or promised) on upstream ``index``."""
        self.shadows[index].clear()
        held = self.router.committed_blocks(index) | self.router.pending_blocks(index)
        if held:
            self.router.on_event(BlocksEvicted(index, list(held)))

    def _prefix_hashes(self, op: PrefillOp) -> list[bytes]:
        size = self.router.block_size
        return list(op.block_hashes(size)[:op.prefix_len // size])

    def _release(self, g: int, hashes: Sequence[bytes]) -> None:
        # Promised blocks that never arrived (those the shadow holds are really there).
        missing = [h for h in hashes if h not in self.shadows[g]]
        if missing:
            self.router.on_event(BlocksEvicted(g, missing))

    def _executed(self, routed: Routed) -> None:
        self.router.on_event(FlopsExecuted(routed.upstream, routed.assignment.cost,
                                           tokens=len(routed.op.token_ids)))
