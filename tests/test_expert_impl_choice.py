"""``expert_impl: auto`` decides from a measured table by rows per expert and device
(issue 43, part 2): the table's shape and rules, parity of every path the chooser can
return against a float64 NumPy SwiGLU on a ``StackLayer`` view at rows per expert that
make it pick that path, "auto" equal to the path it resolves to, and the benchmark's
quick run."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import expert_impls as bench
from moejax import grouped_gemm, moe
from moejax.expert_impl_table import EXPERT_IMPL_TABLE, expert_impl_for
from moejax.expert_views import StackLayer
from moejax.fp8_experts import Fp8Experts

DECODE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


# ------------------------------------------------------------------------- (a) the table
@pytest.mark.parametrize("key", sorted(EXPERT_IMPL_TABLE))
def test_thresholds_ascend_and_end_open(key):
    table = EXPERT_IMPL_TABLE[key]
    bounds = [entry.max_rows_per_expert for entry in table]
    assert bounds == sorted(bounds) and len(set(bounds)) == len(bounds), (key, bounds)
    assert math.isinf(table[-1].max_rows_per_expert) and table[-1].max_experts is None
    for entry in table:
        assert entry.impl in moe.EXPERT_IMPLS and entry.impl != "auto", entry


def test_every_key_of_device_and_bucket_exists():
    assert set(EXPERT_IMPL_TABLE) == {(device, bucket) for device in ("cpu", "gpu")
                                      for bucket in ("small", "large")}


def test_unknown_size_keeps_the_previous_choice():
    assert grouped_gemm.choose_expert_impl(2048, 768, platform="gpu") == "pallas"
    assert grouped_gemm.choose_expert_impl(2048, 100, platform="gpu") == "fused_tiles"
    assert grouped_gemm.choose_expert_impl(2048, 768, platform="cpu") == "fused_tiles"
    assert grouped_gemm.choose_expert_impl(128, 128, platform="cpu", rows=32) == "fused_tiles"


def test_gpu_follows_the_issue_figures():
    # Qwen3-30B-A3B: k=8, E=128; fused_tiles up to 32 tokens (2 rows per expert).
    for tokens in (1, 4, 16, 32):
        assert grouped_gemm.choose_expert_impl(2048, 768, "gpu", rows=8 * tokens,
                                               num_experts=128) == "fused_tiles"
    for tokens in (64, 256, 4096):
        assert grouped_gemm.choose_expert_impl(2048, 768, "cuda", rows=8 * tokens,
                                               num_experts=128) == "pallas"


@pytest.mark.parametrize("hidden,intermediate", [(2048, 100), (100, 768), (120, 64),
                                                 (2056, 760)])
def test_gpu_falls_back_to_fused_tiles_where_pallas_blocks_do_not_divide(hidden,
                                                                         intermediate):
    for rows in (None, 8, 512, 1 << 16):
        assert grouped_gemm.choose_expert_impl(hidden, intermediate, "gpu", rows=rows,
                                               num_experts=128) == "fused_tiles"


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
@pytest.mark.parametrize("hidden,intermediate", [(128, 128), (256, 128), (2048, 768),
                                                 (4096, 1536)])
def test_dense_is_never_chosen_for_many_experts(platform, hidden, intermediate):
    for experts in (64, 128, 256):
        for k in (1, 2, 4, 8):
            for tokens in DECODE_TOKENS:
                impl = expert_impl_for(platform, hidden, intermediate, tokens * k, experts)
                assert impl != "dense", (platform, hidden, experts, k, tokens)


def test_cpu_takes_dense_on_the_demo_decode_step():
    # The demo model (d=128, f=128, E=8, k=2): a 16-token decode step is 32 rows, 4 per
    # expert, where dense measured 25-40 % faster; 256 tokens go back to the tiles.
    assert grouped_gemm.choose_expert_impl(128, 128, "cpu", rows=32, num_experts=8) == "dense"
    assert grouped_gemm.choose_expert_impl(128, 128, "cpu", rows=512,
                                           num_experts=8) == "fused_tiles"
    assert grouped_gemm.choose_expert_impl(128, 128, "cpu", rows=2,
                                           num_experts=8) == "fused_tiles"


def test_monotone_in_rows_for_fixed_experts():
    """Along growing rows per expert the choice changes only at the table's bounds, and
    never returns to a path it left (no flapping between batch sizes)."""
    for key, table in EXPERT_IMPL_TABLE.items():
        platform, bucket = key
        hidden = 128 if bucket == "small" else 2048
        for experts in (8, 16, 32, 64, 128):
            seen: list[str] = []
            for rows in range(1, 64 * experts + 1):
                impl = expert_impl_for(platform, hidden, 768, rows, experts)
                if not seen or seen[-1] != impl:
                    assert impl not in seen or impl == "fused_tiles", (key, experts, rows)
                    seen.append(impl)


# ------------------------------------------------------------------------ (b) parity
def _case(seed: int, tokens: int, k: int, experts: int, d: int, f: int):
    """A random layer-1-of-2 stack, tokens, and a top-k routing with distinct experts."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, d)).astype(np.float32)
    stacks = [(rng.standard_normal(shape) / np.sqrt(shape[2])).astype(np.float32)
              for shape in ((2, experts, d, f), (2, experts, d, f), (2, experts, f, d))]
    chosen = np.stack([rng.choice(experts, k, replace=False) for _ in range(tokens)])
    weights = rng.random((tokens, k)).astype(np.float32)
    weights /= weights.sum(axis=1, keepdims=True)
    return x, stacks, chosen.astype(np.int32), weights


def _reference(x, stacks, chosen, weights, layer: int) -> np.ndarray:
    """Per token: Σ over its k experts of weight · (silu(x·Wg) · (x·Wu)) · Wd, in float64."""
    gate, up, down = (np.asarray(s[layer], np.float64) for s in stacks)
    out = np.zeros(x.shape, np.float64)
    x64 = x.astype(np.float64)
    for t in range(x.shape[0]):
        for j, e in enumerate(chosen[t]):
            g, u = x64[t] @ gate[e], x64[t] @ up[e]
            out[t] += weights[t, j] * ((g / (1 + np.exp(-g))) * u) @ down[e]
    return out


def _moe_forward(x, stacks, chosen, weights, impl: str, layer: int = 1):
    routing = moe.Routing(weights=jnp.asarray(weights), experts=jnp.asarray(chosen))
    experts = stacks[0].shape[1]

    @jax.jit
    def run(x, gate, up, down, layer):
        perm = moe.permute(x, routing, experts)
        views = [StackLayer(s, layer) for s in (gate, up, down)]
        y = moe.expert_compute(perm, *views, impl=impl)
        return moe.combine(y, perm, routing)

    return np.asarray(run(jnp.asarray(x), *map(jnp.asarray, stacks), jnp.int32(layer)))


# (tokens, k, E, d, f, the path the CPU table picks there): rows per expert 0.25, 4, 1,
# 32 and 0.25 (at E=64).
CPU_CASES = [(1, 2, 8, 128, 128, "fused_tiles"), (16, 2, 8, 128, 128, "dense"),
             (8, 4, 32, 128, 64, "dense"), (128, 2, 8, 128, 128, "fused_tiles"),
             (8, 2, 64, 64, 32, "fused_tiles")]


def test_the_cases_cover_every_path_the_cpu_table_names():
    named = {entry.impl for key, table in EXPERT_IMPL_TABLE.items() if key[0] == "cpu"
             for entry in table}
    assert named <= {case[-1] for case in CPU_CASES}


@pytest.mark.parametrize("tokens,k,experts,d,f,expected", CPU_CASES)
def test_auto_on_a_view_equals_the_reference_and_its_path(tokens, k, experts, d, f,
                                                          expected):
    assert grouped_gemm.choose_expert_impl(d, f, "cpu", rows=tokens * k,
                                           num_experts=experts) == expected
    x, stacks, chosen, weights = _case(tokens + experts, tokens, k, experts, d, f)
    want = _reference(x, stacks, chosen, weights, layer=1)
    named = _moe_forward(x, stacks, chosen, weights, expected)
    np.testing.assert_allclose(named, want, rtol=2e-5, atol=2e-5)
    auto = _moe_forward(x, stacks, chosen, weights, "auto")
    np.testing.assert_array_equal(auto, named)
    # Layer 0 of the same stack is another layer (the view reads the one it names).
    np.testing.assert_allclose(_moe_forward(x, stacks, chosen, weights, expected, layer=0),
                               _reference(x, stacks, chosen, weights, layer=0),
                               rtol=2e-5, atol=2e-5)


def test_pallas_interpreted_equals_the_reference_where_the_gpu_table_picks_it():
    tokens, k, experts, d, f = 24, 2, 4, 32, 32            # 12 rows per expert
    assert grouped_gemm.choose_expert_impl(d, f, "gpu", rows=tokens * k,
                                           num_experts=experts) == "pallas"
    x, stacks, chosen, weights = _case(7, tokens, k, experts, d, f)
    np.testing.assert_allclose(_moe_forward(x, stacks, chosen, weights, "pallas"),
                               _reference(x, stacks, chosen, weights, layer=1),
                               rtol=2e-5, atol=2e-5)


def test_fp8_auto_takes_only_fp8_paths(monkeypatch):
    """A table path FP8 weights cannot take ("blocks") becomes fused_tiles."""
    experts, d, f, rows = 4, 32, 32, 8
    rng = np.random.default_rng(3)

    def fp8(shape):
        values = jnp.asarray(rng.standard_normal(shape) / 4, jnp.float32)
        return Fp8Experts(values.astype(jnp.float8_e4m3fn),
                          jnp.ones((experts, 1, 1), jnp.float32), (shape[1], shape[2]))

    w = [fp8((experts, d, f)), fp8((experts, d, f)), fp8((experts, f, d))]
    x = jnp.asarray(rng.standard_normal((rows, d)), jnp.float32)
    sizes = jnp.asarray([3, 0, 4, 1], jnp.int32)
    perm = moe.Permutation(x_sorted=x, order=jnp.arange(rows, dtype=jnp.int32),
                           group_sizes=sizes)
    want = moe.expert_compute(perm, *w, impl="fused_tiles")
    monkeypatch.setattr(grouped_gemm, "choose_expert_impl", lambda *a, **kw: "blocks")
    np.testing.assert_array_equal(moe.expert_compute(perm, *w, impl="auto"), want)


# -------------------------------------------------------------------- (c) the benchmark
def test_entries_follow_from_the_picks():
    assert bench.table_pick({"fused_tiles": 1.0, "dense": 0.97, "gmm": 1.2}) == "fused_tiles"
    assert bench.table_pick({"fused_tiles": 1.0, "dense": 0.8}) == "dense"
    entries = bench.entries_from([(4, "dense"), (0.25, "fused_tiles"), (1, "dense"),
                                  (16, "fused_tiles"), (64, "fused_tiles")])
    assert entries == [(0.25, "fused_tiles"), (4, "dense"), (math.inf, "fused_tiles")]
    assert bench.entries_text(entries) == "0.25:fused_tiles,4:dense,inf:fused_tiles"


@pytest.mark.slow
def test_quick_run_writes_the_named_keys(tmp_path):
    path = tmp_path / "expert_impls.json"
    bench.main(["--quick", "--json", str(path)])
    figures = json.loads(path.read_text())
    for shape in ("demo", "qwen3_cpu"):
        for tokens in bench.QUICK_TOKENS:
            for impl in ("fused_tiles", "gmm"):
                assert figures[f"expert_impl_ms_{shape}_{impl}_{tokens}"] > 0
            assert figures[f"expert_impl_best_{shape}_{tokens}"] in moe.EXPERT_IMPLS
            assert figures[f"expert_impl_chosen_{shape}_{tokens}"] in moe.EXPERT_IMPLS
            assert (f"expert_impl_ms_{shape}_dense_{tokens}" in figures
                    or f"expert_impl_skipped_{shape}_dense_{tokens}" in figures)
            assert figures[f"expert_impl_skipped_{shape}_pallas_{tokens}"]
        assert figures[f"expert_impl_entries_{shape}"].endswith(
            ("inf:fused_tiles", "inf:dense", "inf:gmm"))
    assert figures["expert_impl_rows_per_expert_demo_16"] == 16 * 2 / 8
    assert all(not isinstance(v, (dict, list)) for v in figures.values())   # flat
