"""The plan of a scoring run over an engine's paged prefix KV cache.

The device side is a pool of ``num_blocks`` blocks of ``block_size`` token slots per
layer (``moejax.attention_kinds.PrefixPooled``); its blocks are kept by a
:class:`moejax.kv.BlockAllocator` (chained block hashes, ``moejax.prefix_hash``, each op's
own ``block_hashes``, to pool blocks; references pin the blocks a running plan reads or
writes; unreferenced named blocks are evicted oldest first; ``stored`` / ``evicted``
hashes are recorded for the router). This module decides what lives where.

:func:`plan_run` decides, per sequence of a run, which leading tokens it reads from the
pool instead of computing:

* **across runs** — the longest run of its whole 16-token blocks the cache holds;
* **within the run, token by token** — sequences are taken in sorted token order, so
  each shares its longest common prefix with any earlier one with its predecessor;
  that predecessor stores the KV of those tokens (whole and partial blocks) and the
  sequence continues after them (when they are at least a block's worth). Siblings (a prompt under several candidates), several
  questions over one document, a system prompt under many prompts: every distinct
  prefix token is computed once per run.

A sequence never reads the token at its first score position (its logits are computed
in its own pass). Sequences land in *levels*: a sequence's level is one more than the
highest level of a sequence whose stored tokens it reads, so each level runs after the
ones it reads (in practice 1–3 levels). Whole blocks of a sequence's prefix
(``PrefillOp.prefix_len``: the tokens it shares with its siblings; the whole sequence for
a request on its own) that it computes are named by their hash after the run, for later
runs; other stored blocks are anonymous and freed after the run. Blocks are named by the
op's own ``block_hashes`` (computed once per op: the router matched the same digests).
With ``kv_cache_free`` nothing is looked up or kept; in-run sharing still applies.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from moejax.config import ModelConfig
from moejax.kv import BlockAllocator
from moejax.ops import PrefillOp
from moejax.prefix_hash import BLOCK_SIZE


def blocks_for_budget(cfg: ModelConfig, budget_bytes: int, itemsize: int,
                      block_size: int = BLOCK_SIZE) -> int:
    """Pool blocks that fit ``budget_bytes`` (keys and values of every layer)."""
    per_block = block_size * cfg.kv_bytes_per_token(itemsize)
    return max(0, int(budget_bytes) // per_block)


def sharing_flops(ops: Sequence[PrefillOp], cfg: ModelConfig,
                  block_size: int = BLOCK_SIZE) -> list[int]:
    """FLOPs of each op of one request when they run together with in-call sharing: the
    first op whole, each other one after the prompt tokens it can read from the first (its
    shared ``prefix_len`` up to its first score position, when at least a block's worth:
    what :func:`plan_run` shares). An estimate for admission; the plan may share more."""
    out = []
    for i, op in enumerate(ops):
        shared = 0 if i == 0 else _worth_sharing(min(op.prefix_len, op.reusable_len),
                                                 block_size)
        out.append(op.flops(cfg, cached=shared))
    return out


@dataclasses.dataclass
class PrefixPlan:
    """The derived sequences of a run by level, and the cache bookkeeping.

    A derived sequence keeps its original's key and score entries (positions shifted by
    its ``position_offset``), so the outputs of the levels are the run's outputs."""

    levels: list[list[PrefillOp]]         # level k reads only what levels < k store
    pinned: list[int]                     # blocks to release after the run
    to_commit: list[tuple[int, bytes]]    # computed whole prefix blocks, named after the run
    cached_tokens: int = 0                # tokens read from blocks of earlier runs
    shared_tokens: int = 0                # tokens read from sequences of this run


@dataclasses.dataclass
class _Reach:
    """What a planned sequence leaves readable: the pool slot of each of its first
    ``len(slots)`` tokens, and the level of the sequence that computed it (-1: a block
    of an earlier run)."""

    tokens: np.ndarray
    slots: np.ndarray
    writer_level: np.ndarray


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


def _worth_sharing(tokens: int, block_size: int) -> int:
    """Shared tokens worth reading in-run: at least a block's worth. Reading fewer saves
    little compute but costs a level (one more pass over the engine) and, often, a new
    program shape — two prompts opening with the same word are not worth it."""
    return tokens if tokens >= block_size else 0


def sharing_order(sequences: Sequence[PrefillOp]) -> list[int]:
    """Indices of ``sequences`` in sorted token order: a sequence's longest common prefix
    with any sequence before it is the one with its predecessor."""
    return sorted(range(len(sequences)),
                  key=lambda i: np.asarray(sequences[i].token_ids, ">i4").tobytes())


def plan_run(sequences: Sequence[PrefillOp], cache: BlockAllocator,
             kv_cache_free: bool = False) -> PrefixPlan:
    """Plan a scoring run over the prefix cache (see the module docstring).

    Each op's ``prefix_len`` (tokens shared with siblings) says which of its whole blocks
    are kept for later runs.
    """
    plan = PrefixPlan(levels=[], pinned=[], to_commit=[])
    order = sharing_order(sequences)
    tokens = [np.asarray(sequences[i].token_ids, np.int32) for i in order]
    # Tokens the next sequence in order may read from this one.
    wanted = [_worth_sharing(min(_common_prefix(tokens[j], tokens[j + 1]),
                                 sequences[order[j + 1]].reusable_len), cache.block_size)
              for j in range(len(order) - 1)] + [0]
    naming: set[bytes] = set()
    previous: _Reach | None = None
    for j, index in enumerate(order):
        seq = sequences[index]
        readable = 0 if previous is None else _worth_sharing(min(
            _common_prefix(previous.tokens, tokens[j]), len(previous.slots), seq.reusable_len),
            cache.block_size)
        derived, previous = _plan_sequence(plan, cache, seq, tokens[j], previous, readable,
                                           wanted[j], naming, kv_cache_free)
        level = derived[1]
        while len(plan.levels) <= level:
            plan.levels.append([])
        plan.levels[level].append(derived[0])
    return plan


def _plan_sequence(plan: PrefixPlan, cache: BlockAllocator, seq: PrefillOp, tokens: np.ndarray,
                   previous: _Reach | None, readable: int, wanted: int,
                   naming: set[bytes], kv_cache_free: bool
                   ) -> tuple[tuple[PrefillOp, int], _Reach]:
    """One sequence: its cached blocks, what it reads from its predecessor, what it stores.
    Returns ((derived sequence, level), what it leaves readable)."""
    bs, n, p = cache.block_size, len(tokens), seq.prefix_len
    # The op's own digests (memoized: the router, if any, already computed them); nothing
    # is looked up or named without a cache.
    hashes = () if kv_cache_free else seq.block_hashes(bs)
    cached = [] if kv_cache_free else cache.match(hashes[:seq.reusable_len // bs])
    plan.pinned += cached
    cached_end = len(cached) * bs
    start = max(cached_end, readable)
    context = np.concatenate([cache.slots(cached), previous.slots[cached_end:start]]
                             if start > cached_end else [cache.slots(cached)]).astype(np.int32)
    writers = np.concatenate([np.full(cached_end, -1, np.int32),
                              previous.writer_level[cached_end:start]]
                             if start > cached_end else [np.full(cached_end, -1, np.int32)])
    level = int(writers.max()) + 1 if len(writers) else 0
    plan.cached_tokens += cached_end
    plan.shared_tokens += start - cached_end
    # Store what the next sequence reads and, for later runs, the prefix's whole blocks.
    keep_until = 0 if kv_cache_free else (p // bs) * bs
    if keep_until <= -(-start // bs) * bs:          # no whole block of its own to name
        keep_until = 0
    end = min(n, max(wanted, keep_until))
    stored = np.zeros(0, np.int32)
    store_slots = None
    if end > start:
        first_block, last_block = start // bs, (end - 1) // bs
        count = last_block - first_block + 1
        # No room: nothing stored, nothing shared.
        blocks = cache.allocate(count) if count <= cache.num_available else None
        if blocks is not None:
            plan.pinned += blocks
            offsets = np.arange(start, end)
            stored = (np.asarray(blocks, np.int32)[offsets // bs - first_block] * bs
                      + offsets % bs).astype(np.int32)
            store_slots = np.full(n - start, -1, np.int32)
            store_slots[:end - start] = stored
            for b, block in zip(range(first_block, last_block + 1), blocks):
                whole_here = b * bs >= start and (b + 1) * bs <= keep_until
                if whole_here and hashes[b] not in naming:
                    naming.add(hashes[b])
                    plan.to_commit.append((block, hashes[b]))
    reach = _Reach(tokens=tokens, slots=np.concatenate([context, stored]),
                   writer_level=np.concatenate([writers, np.full(len(stored), level, np.int32)]))
    derived = seq.continuation(start, context_slots=context if start else None,
                               store_slots=store_slots)
    return (derived, level), reach
