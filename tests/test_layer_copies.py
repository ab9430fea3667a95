"""No copy of a layer's experts in the compiled programs (issue 43, part 1).

The experts are stacked ``[L, E, d, f]``; a program that loops over layers and slices
layer l out copies the whole layer per layer per step. Read in place
(``moejax.expert_views``), a step's temporaries hold at most a few experts' matrices.
The check is XLA's own ``memory_analysis()`` of each compiled program on CPU, at a shape
where one layer's experts are 12 MiB: the fused decode step (every expert path that
reads in place), the layerwise MoE program (resident stack, and an offload slot buffer),
the offload slot copy, FP8-kept experts, and the scoring forward. A control compiles
the same layer loop with the layer sliced out (``dispatch.SlicedExperts``) and finds
the copy, so the measure can fail.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import model
from moejax.backends import make_backend
from moejax.config import ModelConfig
from moejax.core.continuous import Scheduler, SchedulerOptions
from moejax.decode import programs
from moejax.decode.factory import make_runner
from moejax.decode.programs import StepOptions
from moejax.dispatch import SlicedExperts, StackedExperts, local_dispatcher
from moejax.model import ForwardOptions
from moejax.moe import route
from moejax.offload.slots import SET_SLOT
from moejax.ops import PrefillOp
from moejax.packing import BucketPolicy, pack

CFG = ModelConfig(model_type="qwen3_moe", vocab_size=256, hidden_size=256, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=64, num_experts=16,
                  num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True,
                  qk_norm=True, rms_norm_eps=1e-6, rope_theta=1e4, max_context=256,
                  tie_word_embeddings=False)
# One layer's expert matrices: 16 experts × 3 × 256 × 256 × 4 bytes = 12 MiB.
LAYER_BYTES = CFG.num_experts * 3 * CFG.hidden_size * CFG.moe_intermediate_size * 4
# The paths a serving program may take on CPU ("pallas" reads the layer through its
# index maps: tests/test_gmm_layer_index.py; "blocks", the training path, gathers one
# matrix per row block, E + 1 or more: as many bytes as a layer, by design; "ragged_dot"
# takes the layer as one array).
IN_PLACE_IMPLS = ("fused_tiles", "gmm", "dense")


@pytest.fixture(scope="module")
def params():
    return model.init_params(CFG, seed=0)


def temporaries(lowered) -> int:
    return lowered.compile().memory_analysis().temp_size_in_bytes


def step_lowered(runner, rows: int, width: int):
    """The fused step program of ``runner`` over rows of padding (lowered, not run)."""
    scheduler = Scheduler(runner, 32, SchedulerOptions(max_batch_size=16,
                                                       max_prefill_tokens=64))
    batch, samp, _, _ = scheduler.paged.build_batch([[]], rows, width)
    batch, samp = jax.device_put((batch, samp), runner.device)
    return lower_flat(lambda *args: programs.fused_step(*args, cfg=runner.cfg,
                                                        opts=runner.opts),
                      runner.params, scheduler.store.pool, batch, samp)


def lower_flat(fn, *args):
    """``jax.jit(fn).lower(*args)`` with the arguments passed as their leaves (lowering
    rebuilds argument pytrees with placeholders, which the runtime type checks of
    KVPool and SamplingParams refuse)."""
    leaves, tree = jax.tree.flatten(args)
    return jax.jit(lambda *leaves: fn(*jax.tree.unflatten(tree, leaves))).lower(*leaves)


@pytest.mark.parametrize("impl", IN_PLACE_IMPLS)
def test_fused_decode_and_prefill_steps_hold_no_layer_copy(params, impl):
    runner = make_runner("resident", CFG, params, dtype="float32",
                         opts=StepOptions(expert_impl=impl))
    for rows, width in ((16, 1), (2, 32)):          # a decode step, a prefill step
        temp = temporaries(step_lowered(runner, rows, width))
        print(f"{impl} {rows}x{width}: temporaries {temp / 2**20:.2f} MiB "
              f"(one layer's experts {LAYER_BYTES / 2**20:.0f} MiB)")
        assert temp < LAYER_BYTES / 2, (impl, rows, width, temp)


def _layer_loop_lowered(params, source_class):
    """Every layer's MoE over 16 rows in one fori_loop, experts from ``source_class``."""
    experts = {k: jnp.asarray(params["layers"][k]) for k in ("w_gate", "w_up", "w_down")}
    router = jnp.asarray(params["layers"]["router"])

    def run(experts, router, x):
        dispatcher = local_dispatcher(source_class(experts), CFG.num_experts, "fused_tiles")

        def body(layer, x):
            routing = route(x, router[layer], CFG.num_experts_per_tok, norm_topk_prob=True)
            y, _ = dispatcher.apply(layer, x, routing, None, dispatcher.init_carry())
            return x + y

        return jax.lax.fori_loop(0, CFG.num_layers, body, x)

    x = jnp.ones((16, CFG.hidden_size), jnp.float32)
    return jax.jit(run).lower(experts, router, x)


def test_the_measure_sees_a_sliced_layer(params):
    """Control: the same loop with the layer sliced out holds a copy of it."""
    in_place = temporaries(_layer_loop_lowered(params, StackedExperts))
    sliced = temporaries(_layer_loop_lowered(params, SlicedExperts))
    print(f"in place {in_place / 2**20:.2f} MiB, sliced {sliced / 2**20:.2f} MiB")
    assert sliced >= LAYER_BYTES > 2 * in_place


def test_layerwise_moe_program_and_offload_slots_hold_no_layer_copy(params):
    opts = StepOptions(expert_impl="fused_tiles")
    experts = {k: jnp.asarray(params["layers"][k]) for k in ("w_gate", "w_up", "w_down")}
    x = jnp.ones((16, CFG.hidden_size), jnp.float32)
    routing = route(x, jnp.asarray(params["layers"]["router"][0]), CFG.num_experts_per_tok,
                    norm_topk_prob=True)
    valid = jnp.ones(16, bool)
    resident = programs.MOE.lower(experts, np.int32(1), x, x, routing, valid, opts=opts)
    temp = temporaries(resident)
    assert temp < LAYER_BYTES / 2, temp
    # An offload slot buffer: one layer's [E', ...] handed in, read as it is.
    slot_buffer = {k: v[0] for k, v in experts.items()}
    assert temporaries(programs.MOE.lower(slot_buffer, None, x, x, routing, valid,
                                          opts=opts)) < LAYER_BYTES / 2
    # The slot copy writes one expert into the (donated) slot buffer in place.
    runner = make_runner("offload", CFG, params, dtype="float32", opts=opts, expert_slots=4)
    host = runner.slots.host
    one_expert = host.expert_to_device(1, 3)
    set_slot = SET_SLOT.lower(runner.slots.buffers(1), np.int32(2), one_expert)
    assert temporaries(set_slot) < LAYER_BYTES / 16, temporaries(set_slot)


def test_fp8_kept_experts_are_read_in_place():
    """FP8 values [L, E, in, out] with block scales: the fused step dequantizes one expert
    where it reads it, without slicing the layer's bytes out first. 64 experts, so one
    layer's FP8 bytes (12 MiB) dwarf the step's other temporaries."""
    from moejax.fp8_experts import device_bits
    block = (128, 128)
    base = dataclasses.replace(CFG, num_experts=64)
    cfg = dataclasses.replace(base, expert_fp8_block=block)
    params = model.init_params(base, seed=0)
    layers = dict(params["layers"])
    for name in ("w_gate", "w_up", "w_down"):
        w = layers[name]
        scale_shape = (*w.shape[:2], -(-w.shape[2] // block[0]), -(-w.shape[3] // block[1]))
        layers[name] = device_bits(w.astype(jnp.float8_e4m3fn))
        layers[f"{name}_scale"] = np.ones(scale_shape, np.float32)
    fp8_params = {**params, "layers": layers}
    runner = make_runner("resident", cfg, fp8_params, dtype="float32",
                         opts=StepOptions(expert_impl="fused_tiles"))
    fp8_layer_bytes = 64 * 3 * CFG.hidden_size * CFG.moe_intermediate_size
    temp = temporaries(step_lowered(runner, 16, 1))
    print(f"fp8 decode step: temporaries {temp / 2**20:.2f} MiB (one layer's FP8 experts "
          f"{fp8_layer_bytes / 2**20:.0f} MiB)")
    assert temp < fp8_layer_bytes / 2, temp


@pytest.mark.parametrize("impl", IN_PLACE_IMPLS)
def test_scoring_forward_holds_no_layer_copy(params, impl):
    backend = make_backend("resident", CFG, params)
    rng = np.random.default_rng(0)
    ops = [PrefillOp(key=i, token_ids=rng.integers(2, CFG.vocab_size, 30).astype(np.int32),
                     score_positions=[29], score_token_ids=[[1, 2]]) for i in range(2)]
    host = pack(ops, BucketPolicy(max_batch_tokens=64, min_block=32))[0]
    opts = dataclasses.replace(host.options, expert_impl=impl)
    assert isinstance(opts, ForwardOptions)
    (lowered,) = backend.lowered_steps([host.batch], opts)
    temp = temporaries(lowered)
    print(f"scoring {impl}: temporaries {temp / 2**20:.2f} MiB")
    assert temp < LAYER_BYTES / 2, (impl, temp)
