"""Static-batching generation (``batching="static"``): batched prefill into a dense KV
cache, then one compiled decode step per token. The baseline continuous batching is
measured against (``benchmarks/generation_serving.py``) and a reference the paged runtime's
tests compare with.

Stages (pure functions, jitted once per shape bucket):

* :func:`prefill_program` — prompts right-padded to [B, P] (each row's tokens at positions
  0..n-1, padding masked out of attention and of the experts) run through the decoder
  layers once; every layer's keys/values go into a fresh :class:`~moejax.static.cache.KVCache`
  [L, B, S, n_kv, h], and the first token is chosen from the logits at each row's last
  prompt token.
* :func:`decode_step_program` — one token per row at its own position: write its keys and
  values into the cache, attend over the row's slots, the MoE layer, the LM head and the
  next-token choice. The same compiled program serves every step of a batch (its shapes
  depend only on the buckets B and S).

Both run the one model (``MoEDecoder.run_layers``, the same layer and MoE dispatcher as
scoring) and differ only in the attention kind: ``PromptToCache`` fills the cache from
the prompts, ``CacheSlots`` writes one token per row and attends over its slots. Both
also return every layer's top-k expert ids of the tokens they ran (expert tracing, an
observation of the layer driver): the routing is computed anyway, so tracing reads it
from the same compiled program and cannot change any output.

:class:`DecodeEngine` drives the loop on the host: it buckets (B to a power of two up to
``max_batch_size``, P and S to powers of two), keeps finished rows out of the experts
(``valid`` = still generating), and stops a row at one of its stop tokens (included in
its tokens, as Hugging Face ``generate`` includes the EOS it stopped on) or after
``max_new_tokens``.
"""

from __future__ import annotations

import collections
import dataclasses
import typing
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from moejax import model, moe, sampling
from moejax.attention_kinds import PackedCausal
from moejax.config import ModelConfig
from moejax.static.cache import CacheSlots, KVCache, PromptToCache, empty_cache
from moejax.moe import ExpertImpl
from moejax.param_layout import Params
from moejax.sequences import SequenceOutput, SequenceSpec
from moejax.sizes import bucket

MIN_PROMPT_BUCKET = 16
MIN_CACHE_BUCKET = 64


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """Static choices of the compiled prefill and decode programs (part of the compile key)."""

    expert_impl: ExpertImpl = "auto"
    tile_rows: int | tuple[int, int] | None = None


@typing.no_type_check   # a pytree: JAX rebuilds it with placeholder leaves
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StaticStepOutput:
    """What prefill and every decode step return.

    cache: the updated KV cache; tokens: [B] int32 next token of every row;
    experts: top-k expert ids of the tokens just run, [L, B, P, k] (prefill) or
    [L, B, k] (decode step).
    """

    cache: KVCache
    tokens: jax.Array
    experts: jax.Array


# ------------------------------------------------------------------------ prefill
def prompt_layout(lengths: Int[Array, "B"], prompt_len: int
                  ) -> tuple[Int[Array, "BP"], Int[Array, "BP"]]:
    """Flat positions [B·P] (0..P-1 per row) and segment ids [B·P] (the row index for a
    prompt token, -1 for padding) of right-padded prompts with ``lengths`` [B]."""
    batch = lengths.shape[0]
    pos = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), (batch, prompt_len))
    rows = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], (batch, prompt_len))
    segments = jnp.where(pos < lengths[:, None], rows, -1)
    return pos.reshape(-1), segments.reshape(-1)


def top_k_ids(layer, routing: moe.Routing, valid, router_input) -> jax.Array:
    """The layer driver's observation for expert tracing: the top-k ids [n, k]."""
    return routing.experts


def prefill_program(params: Params, tokens: Int[Array, "B P"], lengths: Int[Array, "B"],
                    sampling_params: sampling.SamplingParams, *, cfg: ModelConfig,
                    opts: DecodeOptions, cache_len: int) -> StaticStepOutput:
    """Prefill of right-padded prompts ``tokens`` [B, P] with ``lengths`` [B] (>= 1) into a
    new cache of ``cache_len`` slots; the first generated token of each row (token number
    0 of its sampling key). Expert ids come back as [L, B, P, k] (padding rows junk)."""
    _count_compile("prefill")
    batch, prompt_len = tokens.shape
    module = model.decoder(cfg, params)
    positions, segments = prompt_layout(lengths, prompt_len)
    x = module.embed_tokens(tokens.reshape(-1))
    attn = PromptToCache(packed=PackedCausal.of(positions, segments, prompt_len),
                         cache=empty_cache(cfg, batch, cache_len, x.dtype))
    x, attn, _, experts = module.run_layers(
        x, attn, module.local_dispatcher(opts.expert_impl, opts.tile_rows), observe=top_k_ids)
    last = x.reshape(batch, prompt_len, -1)[jnp.arange(batch), lengths - 1]     # [B, d]
    logits = module.vocab_logits(module.final(last))
    first = sampling.next_tokens(logits, sampling_params, jnp.zeros(batch, jnp.int32))
    return StaticStepOutput(cache=attn.cache, tokens=first,
                      experts=experts.reshape(cfg.num_layers, batch, prompt_len, -1))


# ------------------------------------------------------------------------- decode
def decode_step_program(params: Params, cache: KVCache, tokens: Int[Array, "B"],
                        positions: Int[Array, "B"], active: Bool[Array, "B"],
                        sampling_params: sampling.SamplingParams, counters: Int[Array, "B"], *,
                        cfg: ModelConfig, opts: DecodeOptions) -> StaticStepOutput:
    """One decode step: ``tokens`` [B] at ``positions`` [B] -> the next token of every row.

    ``active`` [B] bool: rows still generating (the others are computed but kept out of
    the experts, and their outputs are ignored); ``counters`` [B]: how many tokens each
    row has generated (its sampling key's step). Expert ids: [L, B, k].
    """
    _count_compile("decode_step")
    module = model.decoder(cfg, params)
    attn = CacheSlots(positions=positions, active=active, cache=cache)
    x, attn, _, experts = module.run_layers(
        module.embed_tokens(tokens), attn,
        module.local_dispatcher(opts.expert_impl, opts.tile_rows), observe=top_k_ids)
    logits = module.vocab_logits(module.final(x))
    return StaticStepOutput(cache=attn.cache, tokens=sampling.next_tokens(logits, sampling_params,
                                                                    counters),
                      experts=experts)


# One jitted function per stage, shared by every engine: the compile cache is keyed by
# (cfg, opts, shapes), so engines of the same model and buckets share programs.
PREFILL = jax.jit(prefill_program, static_argnames=("cfg", "opts", "cache_len"))
_DECODE_STEP = jax.jit(decode_step_program, static_argnames=("cfg", "opts"),
                       donate_argnames=("cache",))
# Traces of each program so far: a program body runs in Python only when jit traces it,
# i.e. once per new compile key, so this counts compiled programs without private APIs.
_COMPILES: collections.Counter = collections.Counter()


def _count_compile(program: str) -> None:
    _COMPILES[program] += 1


def compiled_program_counts() -> dict[str, int]:
    """How many programs the prefill and decode-step functions have compiled so far (one
    per model, options and shape bucket; never one per step)."""
    return {"prefill": _COMPILES["prefill"], "decode_step": _COMPILES["decode_step"]}


# ------------------------------------------------------------------------- host loop
@dataclasses.dataclass
class _Rows:
    """Host state of one batch: per row, the tokens so far, the traced decode routing
    (one [L, k] array per step) and whether it still runs."""

    specs: list[SequenceSpec]
    outputs: list[SequenceOutput]
    decode_steps: list[list[np.ndarray]]
    active: np.ndarray          # [B] bool (padding rows: False)

    @classmethod
    def start(cls, specs: list[SequenceSpec], real: int) -> "_Rows":
        """Rows for ``specs``, of which the first ``real`` are requests (the rest pad B)."""
        return cls(specs=specs, outputs=[SequenceOutput([], "length") for _ in specs],
                   decode_steps=[[] for _ in specs], active=np.arange(len(specs)) < real)

    def accept(self, tokens: np.ndarray, decode_experts: np.ndarray | None) -> None:
        """Append each active row's new token; ``decode_experts`` [L, B, k]: the routing
        of the tokens the step ran (each active row's previous token)."""
        for b, spec in enumerate(self.specs):
            if not self.active[b]:
                continue
            out = self.outputs[b]
            if decode_experts is not None:
                self.decode_steps[b].append(decode_experts[:, b])
            token = int(tokens[b])
            out.token_ids.append(token)
            if token in spec.stop_token_ids:
                out.finish_reason, self.active[b] = "stop", False
            elif len(out.token_ids) >= spec.max_new_tokens:
                out.finish_reason, self.active[b] = "length", False


class DecodeEngine:
    """Generates token ids for batches of :class:`SequenceSpec` with one model.

    ``params``: the params pytree (numpy or JAX arrays; placed on the default device once);
    ``max_batch_size``: rows per batch (larger inputs run in several batches; batch shapes
    are powers of two up to it); ``max_cache``: the longest cache (default the model's
    context); ``dtype``: cast the params to it (None: keep theirs).
    """

    def __init__(self, params: Params, cfg: ModelConfig, *, expert_impl: ExpertImpl = "auto",
                 tile_rows: int | tuple[int, int] | None = None, max_batch_size: int = 8,
                 max_cache: int | None = None, dtype: Any = None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        model.check_params(params, cfg)
        self.params = jax.tree.map(lambda a: jnp.asarray(a, dtype), params)
        self.cfg = cfg
        self.opts = DecodeOptions(expert_impl=expert_impl, tile_rows=tile_rows)
        self.max_batch_size = max_batch_size
        self.max_cache = max_cache or cfg.max_context

    def shapes(self, specs: Sequence[SequenceSpec]) -> tuple[int, int, int]:
        """(B, P, S): batch, prompt and cache buckets of one batch of ``specs``."""
        longest_prompt = max(len(s.prompt) for s in specs)
        needed = max(len(s.prompt) + s.max_new_tokens for s in specs)
        if needed > self.max_cache:
            raise ValueError(f"a sequence needs {needed} cache slots, more than "
                             f"{self.max_cache}")
        # P stays a power of two (the attention tiling needs it); the cache is at least
        # P slots even where that exceeds the context (slots past it are never read).
        prompt_len = bucket(longest_prompt, MIN_PROMPT_BUCKET)
        cache_len = max(bucket(needed, MIN_CACHE_BUCKET, self.max_cache), prompt_len)
        return bucket(len(specs), 1, self.max_batch_size), prompt_len, cache_len

    def generate(self, specs: Sequence[SequenceSpec], *, trace: bool = False
                 ) -> list[SequenceOutput]:
        """Outputs in the order of ``specs``. Sequences are batched by length (longest
        first, ``max_batch_size`` per batch) so that rows of a batch need similar caches."""
        order = sorted(range(len(specs)),
                       key=lambda i: -(len(specs[i].prompt) + specs[i].max_new_tokens))
        outputs: list[SequenceOutput | None] = [None] * len(specs)
        for start in range(0, len(order), self.max_batch_size):
            chunk = order[start:start + self.max_batch_size]
            for i, out in zip(chunk, self.run_batch([specs[i] for i in chunk], trace=trace)):
                outputs[i] = out
        return outputs

    def run_batch(self, specs: Sequence[SequenceSpec], *, trace: bool = False
                  ) -> list[SequenceOutput]:
        """Prefill then decode one batch (at most ``max_batch_size`` specs)."""
        if not 0 < len(specs) <= self.max_batch_size:
            raise ValueError(f"a batch holds 1..{self.max_batch_size} sequences, "
                             f"got {len(specs)}")
        batch, prompt_len, cache_len = self.shapes(specs)
        padded = list(specs) + [SequenceSpec(prompt=(0,), max_new_tokens=1)] * (
            batch - len(specs))
        tokens, lengths = pad_prompts(padded, prompt_len)
        # Placed once: every step of the batch reads the same settings.
        samp = jax.device_put(sampling.make_sampling_params(
            [s.temperature for s in padded], [s.top_p for s in padded],
            [s.seed for s in padded]))
        rows = _Rows.start(padded, len(specs))
        out = PREFILL(self.params, tokens, lengths, samp, cfg=self.cfg, opts=self.opts,
                       cache_len=cache_len)
        if trace:
            prefill_ids = np.asarray(out.experts)
            for b in range(len(specs)):
                rows.outputs[b].prefill_experts = prefill_ids[:, b, :lengths[b]]
        rows.accept(np.asarray(out.tokens), None)
        self._decode(rows, out.cache, lengths, samp, trace)
        if trace:
            for b in range(len(specs)):
                rows.outputs[b].decode_experts = _stack_steps(rows.decode_steps[b], self.cfg)
        return rows.outputs[:len(specs)]

    def _decode(self, rows: _Rows, cache: KVCache, lengths: np.ndarray,
                samp: sampling.SamplingParams, trace: bool) -> None:
        """Decode steps until every row has finished (one compiled step, reused)."""
        while rows.active.any():
            generated = np.array([len(o.token_ids) for o in rows.outputs], np.int32)
            # A finished row is parked on slot ``length`` (its own first generated token's
            # slot): it keeps computing junk there that nothing reads.
            positions = np.where(rows.active, lengths + generated - 1, lengths).astype(np.int32)
            last = np.array([o.token_ids[-1] if o.token_ids else 0 for o in rows.outputs],
                            np.int32)   # padding rows never generated a token
            out = _DECODE_STEP(self.params, cache, last, positions, rows.active.copy(), samp,
                               generated, cfg=self.cfg, opts=self.opts)
            cache = out.cache
            rows.accept(np.asarray(out.tokens), np.asarray(out.experts) if trace else None)


def pad_prompts(specs: Sequence[SequenceSpec], prompt_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded tokens [B, P] int32 (padding id 0) and lengths [B] int32."""
    tokens = np.zeros((len(specs), prompt_len), np.int32)
    lengths = np.array([len(s.prompt) for s in specs], np.int32)
    for b, spec in enumerate(specs):
        tokens[b, :len(spec.prompt)] = spec.prompt
    return tokens, lengths


def _stack_steps(steps: list[np.ndarray], cfg: ModelConfig) -> np.ndarray:
    """Per-step decode expert ids (each [L, k]) -> [L, steps, k] int32."""
    if not steps:
        return np.zeros((cfg.num_layers, 0, cfg.num_experts_per_tok), np.int32)
    return np.stack(steps, axis=1).astype(np.int32)
