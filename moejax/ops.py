"""The prefill op: one record for one forward pass, from the request to its result.

A scoring request becomes one or more :class:`PrefillOp` s (``serving.requests``); the
router (``moejax.core.router``), the prefix cache (``moejax.core.prefix_plan``), the packer
(``moejax.packing``) and the engine (``moejax.core.scoring_engine``) all read that same record, and
the results are matched back to it by its ``key``. What more than one of them needs is
derived here, once:

* ``block_hashes(block_size)`` — the chained digests (``moejax.prefix_hash``) of its whole
  blocks, which the router matches and the prefix cache looks up and stores under;
* ``flops(cfg, cached)`` — its cost in the FLOP model of ``moejax.config.ModelConfig``.

Both are memoized on the record (per block size; per cached-token count), so an op routed
to an engine and then planned by that engine's cache is hashed once.

Two costs, one formula. ``op.flops(cfg)`` is what running the op costs: every token
attends over the ones before it, plus the LM head at its score positions. The router's
ΔW on an engine that already holds the KV of the op's first ``c`` tokens (seed Eq. (2))
is ``op.flops(cfg, cached=c)``: the tokens from c on, at their true positions. The engine
runs exactly that when its cache supplies those tokens — the continuation record
``op.continuation(c, ...)`` has ``position_offset = c`` and costs
``continuation.flops(cfg) == op.flops(cfg, cached=c)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import numpy as np

from moejax import prefix_hash
from moejax.config import ModelConfig

_INT32_MAX = 2**31 - 1


class OpKey(NamedTuple):
    """Identity of an op made by the request normalizer (unique within one call)."""

    request_index: int      # position of the request in the call
    candidate_index: int    # sibling op of that candidate; -1: one op reads every candidate


@dataclasses.dataclass(frozen=True, eq=False)
class PrefillOp:
    """One sequence to prefill and the logits to read from it.

    key: identity within one call (results come back keyed by it; the normalizer uses
    :class:`OpKey`). token_ids: [n] int32, read-only. score_positions: indices in [0, n)
    whose next-token logits are read; score_token_ids: per score position, the vocabulary
    ids wanted; full_vocab: whether the log-sum-exp over the vocabulary is needed there too;
    top_k: how many of the most likely ids (and their logits) to read there as well
    (needs full_vocab).
    prefix_len: the first tokens, shared with sibling ops (the prompt of a request expanded
    per candidate); None = all n. Only the prefix's whole blocks are worth keeping.

    Continuing cached KV (the prefix pool of ``moejax.attention_kinds``; made by
    :meth:`continuation`):
    position_offset is the position of token 0; context_slots [c] the prefix-pool token
    slots of the c tokens before it, in order; store_slots [≤ n] the pool slot to keep
    token j's keys and values in (-1: not kept).
    """

    key: Hashable
    token_ids: np.ndarray | Sequence[int]     # stored as a read-only int32 array
    # The constructor accepts any int sequences (NumPy ints too) and stores plain tuples.
    score_positions: Sequence[int | np.integer] | np.ndarray
    score_token_ids: Sequence[Sequence[int | np.integer] | np.ndarray]
    full_vocab: bool | np.bool_ = False
    prefix_len: int | np.integer | None = None
    top_k: int | np.integer = 0
    position_offset: int | np.integer = 0
    context_slots: np.ndarray | Sequence[int] | None = None
    store_slots: np.ndarray | Sequence[int] | None = None
    # Derived values, filled on first use (frozen: mutating these dicts is the only write).
    # Keyed by plain ints (block size; cached tokens, plus "cfg": the config they are for),
    # so a lookup allocates nothing the garbage collector tracks — routing thousands of ops
    # would otherwise trigger collections over the router's large block tables.
    _hashes: dict = dataclasses.field(default_factory=dict, init=False, repr=False)
    _costs: dict = dataclasses.field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        tokens = _as_token_array(self.token_ids, self.key)
        n = len(tokens)
        if n == 0:
            raise ValueError(f"sequence {self.key!r} is empty")
        positions = tuple(int(p) for p in self.score_positions)
        if len(positions) != len(self.score_token_ids):
            raise ValueError(f"sequence {self.key!r}: {len(positions)} score positions "
                             f"but {len(self.score_token_ids)} candidate lists")
        bad = [p for p in positions if not 0 <= p < n]
        if bad:
            raise ValueError(f"sequence {self.key!r}: score positions {bad} outside [0, {n})")
        prefix = n if self.prefix_len is None else int(self.prefix_len)
        if not 0 <= prefix <= n:
            raise ValueError(f"sequence {self.key!r}: prefix_len ({prefix}) must lie in "
                             f"[0, {n}] (its token count)")
        if self.position_offset < 0:
            raise ValueError(f"sequence {self.key!r}: position_offset must be >= 0")
        if self.top_k < 0 or (self.top_k and not self.full_vocab):
            raise ValueError(f"sequence {self.key!r}: top_k ({self.top_k}) must be >= 0, "
                             f"and needs full_vocab")
        # Frozen: normalise once here so that every reader sees plain ints and tuples.
        set_field = object.__setattr__
        set_field(self, "token_ids", tokens)
        set_field(self, "score_positions", positions)
        set_field(self, "score_token_ids",
                  tuple(tuple(int(t) for t in ids) for ids in self.score_token_ids))
        set_field(self, "full_vocab", bool(self.full_vocab))
        set_field(self, "prefix_len", prefix)
        set_field(self, "position_offset", int(self.position_offset))
        set_field(self, "top_k", int(self.top_k))

    # ------------------------------------------------------------------ identity
    @property
    def request_index(self) -> int:
        """Index of the request this op answers (ops keyed by an :class:`OpKey`)."""
        return self._op_key()[0]

    @property
    def candidate_index(self) -> int:
        """The candidate this sibling op scores; -1 when one op reads every candidate."""
        return self._op_key()[1]

    def _op_key(self) -> tuple[int, int]:
        if not (isinstance(self.key, tuple) and len(self.key) == 2):
            raise TypeError(f"op {self.key!r} was not made by the request normalizer: its key "
                            f"is not an OpKey(request_index, candidate_index)")
        return self.key

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, PrefillOp):
            return NotImplemented
        return all(_same(getattr(self, f.name), getattr(other, f.name))
                   for f in dataclasses.fields(self) if f.init)

    __hash__ = None     # holds arrays: compare by value, look up by ``key``

    # ------------------------------------------------------------------ the prefix plan
    @property
    def reusable_len(self) -> int:
        """Tokens before the first score position: the most an engine may read from cached
        KV instead of computing (the logits at a score position need its own pass)."""
        return min(self.score_positions) if self.score_positions else len(self.token_ids) - 1

    @property
    def uses_pool(self) -> bool:
        """Whether this op reads or writes the prefix pool."""
        return ((self.context_slots is not None and len(self.context_slots) > 0)
                or (self.store_slots is not None and bool(np.any(self.store_slots >= 0))))

    def continuation(self, start: int, context_slots: np.ndarray | None,
                     store_slots: np.ndarray | None) -> PrefillOp:
        """This op with its first ``start`` tokens read from the pool (``context_slots``)
        instead of computed: same key and score entries, positions shifted."""
        return dataclasses.replace(
            self, token_ids=self.token_ids[start:], position_offset=self.position_offset + start,
            score_positions=tuple(q - start for q in self.score_positions),
            prefix_len=max(0, self.prefix_len - start),
            context_slots=context_slots, store_slots=store_slots)

    # ------------------------------------------------------------------ derived, memoized
    def block_hashes(self, block_size: int = prefix_hash.BLOCK_SIZE) -> tuple[bytes, ...]:
        """Chained digests of the whole blocks this op may share: those of its prefix (which
        the router matches and an engine keeps) and those before its first score position
        (which an engine may read). ``hashes[:prefix_len // block_size]`` are the prefix's.

        Computed once per block size, so the router and the engine's prefix cache read the
        same tuple."""
        hashes = self._hashes.get(block_size)
        if hashes is None:
            if self.position_offset:
                # Chained hashes name a block by everything before it, which a
                # continuation does not hold.
                raise ValueError(f"sequence {self.key!r} continues at position "
                                 f"{self.position_offset}: it has no block hashes of its own")
            length = max(self.prefix_len, self.reusable_len)
            hashes = tuple(prefix_hash.block_hashes(self.token_ids[:length], block_size))
            self._hashes[block_size] = hashes
        return hashes

    def head_flops(self, cfg: ModelConfig) -> int:
        """F_head summed over the score positions: the whole vocabulary row when the
        vocabulary log-sum-exp is needed, else only the candidate columns."""
        return sum(cfg.head_flops(None if self.full_vocab else len(ids))
                   for ids in self.score_token_ids)

    def flops(self, cfg: ModelConfig, cached: int = 0) -> int:
        """Useful FLOPs of running this op when the KV of its first ``cached`` tokens is
        already held (0 ≤ cached ≤ n): tokens ``cached..n-1`` through every layer, each
        attending over all before it, and the LM head at the score positions.

        ``cached=0``: what the engine executes for this op (for a continuation, the part it
        runs). ``cached=c``: the router's ΔW on an engine holding c tokens of the op (seed
        Eq. (2): ``cfg.request_flops(p, s, cached=c)`` with p + s = n — the prefix/suffix
        split does not change the sum). Memoized per cached count, for one config at a time."""
        costs = self._costs
        if costs.get("cfg") is not cfg:      # a process serves one model: another config resets
            costs.clear()
            costs["cfg"] = cfg
        cost = costs.get(cached)
        if cost is None:
            start = self.position_offset
            body = cfg.request_flops(prefix=start + len(self.token_ids), cached=start + cached,
                                     scoring_positions=0)
            cost = costs[cached] = body + self.head_flops(cfg)
        return cost


@dataclasses.dataclass
class OpOutput:
    """What the model returns for one op.

    ``logits[i]``: logits of ``score_token_ids[i]`` at ``score_positions[i]``.
    ``logsumexp[i]``: log-sum-exp of the full-vocabulary logits there (required
    when ``full_vocab``; used whenever present).
    ``top_ids[i]``, ``top_logits[i]``: the op's ``top_k`` most likely ids there and their
    logits, best first ([n, top_k]; None when top_k is 0).
    """

    logits: list[np.ndarray]
    logsumexp: np.ndarray | None = None
    top_ids: np.ndarray | None = None
    top_logits: np.ndarray | None = None


def _as_token_array(token_ids: Sequence[int] | np.ndarray, key: Hashable) -> np.ndarray:
    """``token_ids`` as a read-only int32 array (checked before the cast, which would wrap
    out-of-range ids silently)."""
    array = np.asarray(token_ids)
    if array.ndim != 1:
        raise ValueError(f"sequence {key!r}: token_ids must be one-dimensional, "
                         f"got shape {array.shape}")
    if array.dtype != np.int32:
        if array.size == 0:
            array = array.astype(np.int32)
        elif not np.issubdtype(array.dtype, np.integer):
            raise TypeError(f"sequence {key!r}: token ids must be integers, got {array.dtype}")
        elif int(array.min()) < 0 or int(array.max()) > _INT32_MAX:
            raise ValueError(f"sequence {key!r}: token ids must lie in [0, 2**31)")
        else:
            array = array.astype(np.int32)
    view = array.view()          # read-only view: the caller's array keeps its own flags
    view.flags.writeable = False
    return view


def _same(a: Any, b: Any) -> bool:
    """Field equality, arrays by value."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if a is None or b is None:
            return a is b
        return np.array_equal(a, b)
    return a == b
