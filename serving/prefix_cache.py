"""The engine's paged prefix KV cache: block bookkeeping and the plan of a scoring run.

The device side is a pool of ``num_blocks`` blocks of ``block_size`` token slots per
layer (``moejax.prefix_forward``); this module decides what lives where.

:class:`PrefixCache` maps chained block hashes (``serving.prefix_hash``) to pool
blocks, counts references (blocks a running plan reads or writes are pinned), keeps
unreferenced blocks in LRU order and evicts the oldest when it needs room, and
records ``stored`` / ``evicted`` hashes for the router.

:func:`plan_run` turns a run's sequences into three phases:

* phase 0 — leading whole blocks that several distinct prefixes have in common (a
  system prompt under different questions) and no cache holds yet, once per longest
  shared run, stored;
* phase 1 — every distinct prefix (the ``prefix_len`` tokens sibling sequences share,
  e.g. the prompt of a multi-selection request) is computed once, after its longest
  cached run of blocks (cross-batch reuse), and its new whole blocks are written to
  the pool; a sequence without siblings runs whole here (continuing its cached
  blocks and storing its new ones);
* phase 2 — each sibling runs only its suffix (from its prefix's last whole block)
  against the pooled prefix (in-batch sharing).

Score entries keep their owner: :meth:`PrefixPlan.assemble` gives each original
sequence its logits in its own order. With ``kv_cache_free`` nothing is looked up or
kept after the run; in-run sharing still applies.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Hashable, Sequence

import numpy as np

from moejax.config import ModelConfig
from moejax.packing import ScoringSequence
from serving.prefix_hash import BLOCK_SIZE, block_hashes

SequenceOutput = tuple[list[np.ndarray], "np.ndarray | None"]


def blocks_for_budget(cfg: ModelConfig, budget_bytes: int, itemsize: int,
                      block_size: int = BLOCK_SIZE) -> int:
    """Pool blocks that fit ``budget_bytes`` (keys and values of every layer)."""
    per_block = 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * itemsize
    return max(0, int(budget_bytes) // per_block)


class PrefixCache:
    """Block table of one engine's prefix pool (host side)."""

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"a prefix cache needs at least one block, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._refs = [0] * num_blocks
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._free = list(range(num_blocks - 1, -1, -1))
        self.stored: list[bytes] = []       # drained by the caller (router events)
        self.evicted: list[bytes] = []
        self.hits = self.lookups = self.evictions = 0

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def resident(self) -> int:
        return len(self._block_of)

    def slots(self, blocks: Sequence[int]) -> np.ndarray:
        """Pool token slots of ``blocks``, in order."""
        offsets = np.arange(self.block_size, dtype=np.int32)
        return (np.asarray(blocks, np.int32)[:, None] * self.block_size + offsets).reshape(-1)

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """Blocks of the longest cached run of ``hashes`` (chained: stop at the first miss),
        pinned for the caller (release them after use)."""
        blocks = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        self.lookups += len(hashes)
        self.hits += len(blocks)
        for block in blocks:
            self._pin(block)
        return blocks

    def allocate(self, count: int) -> list[int] | None:
        """``count`` pinned blocks (free ones first, then evicting the least recently used
        unreferenced ones), or None — and nothing taken — if that many cannot be had."""
        if count > len(self._free) + len(self._lru):
            return None
        out = []
        for _ in range(count):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._lru.popitem(last=False)
                h = self._hash_of.pop(block)
                del self._block_of[h]
                self.evicted.append(h)
                self.evictions += 1
            self._refs[block] = 1
            out.append(block)
        return out

    def commit(self, block: int, h: bytes) -> bool:
        """Name a written block by its hash, so later runs can find it. False (and the block
        stays anonymous, freed on release) if another block already holds that hash."""
        if h in self._block_of:
            return False
        self._block_of[h] = block
        self._hash_of[block] = h
        self.stored.append(h)
        return True

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; unreferenced named blocks become evictable
        (most recently used last), anonymous ones free."""
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block] < 0:
                raise RuntimeError(f"prefix block {block} released more often than taken")
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._lru[block] = None
                else:
                    self._free.append(block)

    def _pin(self, block: int) -> None:
        if self._refs[block] == 0:
            self._lru.pop(block, None)
        self._refs[block] += 1

    def drain_events(self) -> tuple[list[bytes], list[bytes]]:
        """(stored, evicted) hashes since the last call."""
        stored, evicted = self.stored, self.evicted
        self.stored, self.evicted = [], []
        return stored, evicted


@dataclasses.dataclass
class PrefixPlan:
    """Two phases of derived sequences, and where each score entry came from."""

    phase0: list[ScoringSequence]
    phase1: list[ScoringSequence]
    phase2: list[ScoringSequence]
    owners: dict[Hashable, list[tuple[Hashable, int]]]   # derived key -> (original key, entry)
    entries: dict[Hashable, int]                           # original key -> number of entries
    pinned: list[int]                                      # blocks to release after the run
    to_commit: list[tuple[int, bytes]]                     # new blocks, named after the run
    prefix_tokens: int = 0                                 # tokens computed for shared prefixes
    cached_tokens: int = 0                                 # prefix tokens read from the cache

    def assemble(self, outputs: dict[Hashable, SequenceOutput]) -> dict[Hashable, SequenceOutput]:
        """Per original key: (logits per score entry, log-sum-exp per entry or None)."""
        logits: dict[Hashable, list] = {k: [None] * n for k, n in self.entries.items()}
        lse: dict[Hashable, list] = {k: [None] * n for k, n in self.entries.items()}
        for derived, owners in self.owners.items():
            per_position, seq_lse = outputs[derived]
            for j, (key, entry) in enumerate(owners):
                logits[key][entry] = per_position[j]
                lse[key][entry] = None if seq_lse is None else seq_lse[j]
        out = {}
        for key in self.entries:
            values = lse[key]
            out[key] = (logits[key], None if any(v is None for v in values)
                        else np.asarray(values, np.float32))
        return out


@dataclasses.dataclass
class _Builder:
    """Accumulates derived sequences (phase, tokens, entries) while planning."""

    cache: PrefixCache
    by_key: dict[Hashable, ScoringSequence]
    plan: PrefixPlan
    counter: itertools.count = dataclasses.field(default_factory=itertools.count)

    def add(self, phase: list, tokens: np.ndarray, offset: int, entries, context: np.ndarray,
            store: np.ndarray | None) -> None:
        """A derived sequence: ``tokens`` at positions offset…, score ``entries``
        [(original key, entry index, position, ids)], continuing the pool ``context``."""
        key = ("derived", next(self.counter))
        self.plan.owners[key] = [(k, e) for k, e, _, _ in entries]
        phase.append(ScoringSequence(
            key=key, token_ids=tokens, score_positions=tuple(p - offset for _, _, p, _ in entries),
            score_token_ids=tuple(ids for _, _, _, ids in entries),
            full_vocab=any(self.by_key[k].full_vocab for k, _, _, _ in entries),
            position_offset=offset, context_slots=context if len(context) else None,
            store_slots=store))


def _entries(seq: ScoringSequence) -> list[tuple[Hashable, int, int, tuple[int, ...]]]:
    return [(seq.key, i, p, ids)
            for i, (p, ids) in enumerate(zip(seq.score_positions, seq.score_token_ids))]


def _store_slots(cache: PrefixCache, length: int, first_new: int, new_blocks: Sequence[int]
                 ) -> np.ndarray | None:
    """Pool slots for tokens [0, length) of a segment starting at block ``first_new``:
    the tokens of the new whole blocks, -1 after them."""
    if not new_blocks:
        return None
    slots = np.full(length, -1, np.int32)
    new = cache.slots(new_blocks)
    slots[:min(length, len(new))] = new[:length]
    return slots


@dataclasses.dataclass
class _Group:
    """Sequences sharing one exact prefix of ``p`` tokens, and its blocks."""

    members: list[ScoringSequence]
    p: int
    tokens: np.ndarray
    full: int                    # whole blocks in the prefix
    usable: int                  # blocks that may be read from the pool (scores stay computed)
    hashes: list[bytes]
    cached: list[int]            # its leading blocks already in the pool


def plan_run(sequences: Sequence[ScoringSequence], prefix_lens: dict[Hashable, int],
             cache: PrefixCache, kv_cache_free: bool = False) -> PrefixPlan:
    """Plan a scoring run over the prefix cache (see the module docstring).

    prefix_lens: key -> tokens shared with siblings (0 or absent: the whole sequence is
    its own prefix, cached for later runs and shared in this one only through leading
    whole blocks it has in common with other prefixes).
    """
    by_key = {s.key: s for s in sequences}
    plan = PrefixPlan(phase0=[], phase1=[], phase2=[], owners={},
                      entries={s.key: len(s.score_positions) for s in sequences},
                      pinned=[], to_commit=[])
    build = _Builder(cache, by_key, plan)
    by_prefix: dict[tuple, list[ScoringSequence]] = {}
    for seq in sequences:
        p = prefix_lens.get(seq.key) or len(seq.token_ids)
        by_prefix.setdefault((p, tuple(np.asarray(seq.token_ids[:p]).tolist())), []).append(seq)
    groups = [_group(cache, members, p, kv_cache_free) for (p, _), members in by_prefix.items()]
    for group in groups:
        plan.pinned += group.cached
    planned = _plan_shared_leading_blocks(build, groups, kv_cache_free)
    for group in groups:
        _plan_group(build, group, planned, kv_cache_free)
    return plan


def _group(cache: PrefixCache, members: list[ScoringSequence], p: int,
           kv_cache_free: bool) -> _Group:
    bs = cache.block_size
    tokens = np.asarray(members[0].token_ids)
    full = p // bs
    first_score = min(min(s.score_positions) for s in members)
    usable = min(full, first_score // bs)
    hashes = block_hashes(tokens[:full * bs], bs)
    cached = [] if kv_cache_free else cache.match(hashes[:usable])
    return _Group(members, p, tokens, full, usable, hashes, cached)


def _plan_shared_leading_blocks(build: _Builder, groups: list[_Group],
                                kv_cache_free: bool) -> dict[bytes, int]:
    """Phase 0: leading whole blocks that two or more distinct prefixes have in common
    (e.g. a system prompt under different questions), not yet cached, computed once per
    longest shared run and stored. Returns hash -> pool block of what it stores."""
    cache, plan, bs = build.cache, build.plan, build.cache.block_size
    count: collections.Counter = collections.Counter()
    for g in groups:
        count.update(g.hashes[len(g.cached):g.usable])
    depth = {}
    for i, g in enumerate(groups):
        d = len(g.cached)
        while d < g.usable and count[g.hashes[d]] >= 2:
            d += 1
        if d > len(g.cached):
            depth[i] = d
    inner = {groups[i].hashes[j]                  # hashes inside someone's longer run
             for i, d in depth.items() for j in range(len(groups[i].cached), d - 1)}
    planned: dict[bytes, int] = {}
    for i, d in depth.items():
        g = groups[i]
        end = g.hashes[d - 1]
        if end in inner or end in planned:        # covered by a longer (or the same) run
            continue
        c = len(g.cached)
        todo = [j for j in range(c, d) if g.hashes[j] not in planned]
        new = cache.allocate(len(todo))
        if new is None:                            # no room: the groups compute their own
            continue
        plan.pinned += new
        store = np.full((d - c) * bs, -1, np.int32)
        for j, block in zip(todo, new):
            planned[g.hashes[j]] = block
            store[(j - c) * bs:(j - c + 1) * bs] = cache.slots([block])
            if not kv_cache_free:
                plan.to_commit.append((block, g.hashes[j]))
        build.add(plan.phase0, g.tokens[c * bs:d * bs], c * bs, [], cache.slots(g.cached), store)
        plan.prefix_tokens += (d - c) * bs
    return planned


def _plan_group(build: _Builder, group: _Group, planned: dict[bytes, int],
                kv_cache_free: bool) -> None:
    cache, plan, bs = build.cache, build.plan, build.cache.block_size
    members, tokens, full, hashes = group.members, group.tokens, group.full, group.hashes
    cached = list(group.cached)
    while len(cached) < group.usable and hashes[len(cached)] in planned:   # from phase 0
        cached.append(planned[hashes[len(cached)]])
    c = len(cached)
    shared = len(members) > 1
    keep = shared or not kv_cache_free           # singles store blocks only for later runs
    new = cache.allocate(full - c) if keep and full > c else []
    if new is None:                              # no room: run without storing
        new = []
    plan.pinned += new
    if not kv_cache_free:
        plan.to_commit += list(zip(new, hashes[c:c + len(new)]))
    stored_until = (c + len(new)) * bs          # tokens in the pool after phase 1
    context = cache.slots(cached)
    plan.cached_tokens += c * bs * len(members)
    if not shared or not new:
        # A single sequence, or a shared prefix with nothing new to store: each runs whole
        # after the cached blocks.
        for seq in members:
            seq_tokens = np.asarray(seq.token_ids)
            build.add(plan.phase1, seq_tokens[c * bs:], c * bs, _entries(seq), context,
                      _store_slots(cache, len(seq_tokens) - c * bs, c, new) if not shared else None)
        return
    # Shared: the new whole blocks once (phase 1), then each suffix from stored_until.
    head_entries = [e for s in members for e in _entries(s) if e[2] < stored_until]
    build.add(plan.phase1, tokens[c * bs:stored_until], c * bs, head_entries, context,
              cache.slots(new))
    plan.prefix_tokens += stored_until - c * bs
    full_context = cache.slots(cached + new)
    for seq in members:
        tail = [e for e in _entries(seq) if e[2] >= stored_until]
        if tail:
            build.add(plan.phase2, np.asarray(seq.token_ids)[stored_until:], stored_until, tail,
                      full_context, None)
