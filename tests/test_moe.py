"""The MoE stages (moejax.moe) and grouped GEMMs (moejax.grouped_gemm) against float64 NumPy."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from moejax import grouped_gemm as gg
from moejax import moe

BF16 = np.dtype(ml_dtypes.bfloat16)


# ----------------------------------------------------------------------------- references
def np_gmm(lhs: np.ndarray, rhs: np.ndarray, sizes) -> np.ndarray:
    """float64 grouped matmul; rows past sum(sizes) are 0."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for g, size in enumerate(sizes):
        out[start:start + size] = lhs[start:start + size] @ rhs[g]
        start += size
    return out


def np_silu(x):
    return x / (1.0 + np.exp(-x))


def np_swiglu(x, wg, wu, wd):
    return (np_silu(x @ wg) * (x @ wu)) @ wd


def np_grouped_swiglu(x, wg, wu, wd, sizes) -> np.ndarray:
    x, wg, wu, wd = (np.asarray(a, np.float64) for a in (x, wg, wu, wd))
    out = np.zeros((x.shape[0], wd.shape[2]))
    start = 0
    for g, size in enumerate(sizes):
        out[start:start + size] = np_swiglu(x[start:start + size], wg[g], wu[g], wd[g])
        start += size
    return out


def np_route(x, router, k, norm_topk_prob):
    logits = np.asarray(x, np.float64) @ np.asarray(router, np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    experts = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, experts, axis=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(-1, keepdims=True)
    return weights, experts


def np_moe(x, router, wg, wu, wd, k, norm_topk_prob):
    weights, experts = np_route(x, router, k, norm_topk_prob)
    x64 = np.asarray(x, np.float64)
    out = np.zeros_like(x64)
    for t in range(x.shape[0]):
        for j in range(k):
            e = experts[t, j]
            out[t] += weights[t, j] * np_swiglu(x64[t:t + 1], np.float64(wg[e]), np.float64(wu[e]),
                                                np.float64(wd[e]))[0]
    return out


def rel_err(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    scale = np.max(np.abs(ref))
    return float(np.max(np.abs(got - ref)) / (scale if scale else 1.0))


# ----------------------------------------------------------------------------- jitted entry points
@functools.partial(jax.jit, static_argnames=("tile_rows",))
def _gmm(lhs, rhs, sizes, tile_rows):
    return gg.gmm(lhs, rhs, sizes, tile_rows=tile_rows)


_ragged = jax.jit(gg.ragged_dot_gmm)


@functools.partial(jax.jit, static_argnames=("tile_rows",))
def _swiglu_tiles(x, wg, wu, wd, sizes, tile_rows):
    return gg.grouped_swiglu_tiles(x, wg, wu, wd, sizes, tile_rows=tile_rows)


_swiglu_dense = jax.jit(gg.swiglu_dense)
_swiglu_blocks = jax.jit(functools.partial(gg.swiglu_blocks, block_rows=4))


# Group-size cases over E = 5 experts and M = 18 rows (one shape, so one compile per
# dtype and path); M is not a multiple of the tile size and may exceed sum(sizes).
M_ROWS = 18
GROUP_CASES = {
    "random_with_zeros": [3, 0, 7, 0, 5],      # 15 routed rows, 3 trailing rows
    "one_expert_all_rows": [0, 0, 18, 0, 0],
    "last_expert_only": [0, 0, 0, 0, 6],
    "first_expert_only": [9, 0, 0, 0, 0],
    "all_empty": [0, 0, 0, 0, 0],
    "full_no_tail": [4, 4, 1, 4, 5],
}
D_IN, D_OUT, NUM_E, TILE = 8, 12, 5, 4


def _gmm_inputs(case: str, dtype, seed: int = 0):
    sizes = GROUP_CASES[case]
    rng = np.random.default_rng(seed)
    lhs = rng.standard_normal((M_ROWS, D_IN)).astype(dtype)
    rhs = rng.standard_normal((NUM_E, D_IN, D_OUT)).astype(dtype)
    return lhs, rhs, np.asarray(sizes, np.int32)


@pytest.mark.parametrize("case", list(GROUP_CASES))
@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (BF16, 1e-2)], ids=["f32", "bf16"])
@pytest.mark.parametrize("impl", ["gmm", "ragged_dot"])
def test_grouped_gemm_vs_numpy(case, dtype, tol, impl):
    lhs, rhs, sizes = _gmm_inputs(case, dtype)
    if impl == "gmm":
        out = _gmm(lhs, rhs, sizes, tile_rows=TILE)
    else:
        out = _ragged(lhs, rhs, sizes)
    assert out.shape == (lhs.shape[0], D_OUT) and out.dtype == jnp.dtype(dtype)
    out = np.asarray(out, np.float64)
    ref = np_gmm(lhs, rhs, sizes)
    routed = int(sizes.sum())
    assert np.all(out[routed:] == 0.0), "rows beyond sum(group_sizes) must be 0"
    if routed:
        assert rel_err(out, ref) <= tol


def test_gmm_tile_rows_do_not_change_result():
    lhs, rhs, sizes = _gmm_inputs("random_with_zeros", np.float32, seed=3)
    results = [np.asarray(_gmm(lhs, rhs, sizes, tile_rows=tm))
               for tm in (TILE, 1, 32, (4, 2), (8, 3), (16, 16))]
    for other in results[1:]:
        np.testing.assert_allclose(other, results[0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", list(GROUP_CASES))
@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-5), (BF16, 2e-2)], ids=["f32", "bf16"])
@pytest.mark.parametrize("impl", ["tiles", "dense", "blocks"])
def test_grouped_swiglu_vs_numpy(case, dtype, tol, impl):
    sizes = np.asarray(GROUP_CASES[case], np.int32)
    m = M_ROWS
    rng = np.random.default_rng(1)
    d, f = 8, 6
    x = rng.standard_normal((m, d)).astype(dtype)
    wg = (rng.standard_normal((NUM_E, d, f)) / np.sqrt(d)).astype(dtype)
    wu = (rng.standard_normal((NUM_E, d, f)) / np.sqrt(d)).astype(dtype)
    wd = (rng.standard_normal((NUM_E, f, d)) / np.sqrt(f)).astype(dtype)
    if impl == "tiles":
        out = _swiglu_tiles(x, wg, wu, wd, sizes, tile_rows=TILE)
    elif impl == "blocks":
        out = _swiglu_blocks(x, wg, wu, wd, sizes)
    else:
        out = _swiglu_dense(x, wg, wu, wd, sizes)
    assert out.shape == (m, d) and out.dtype == jnp.dtype(dtype)
    out = np.asarray(out, np.float64)
    routed = int(sizes.sum())
    assert np.all(out[routed:] == 0.0)
    if routed:
        # bf16: the [rows, f] intermediate is rounded to bf16 before the down projection.
        assert rel_err(out, np_grouped_swiglu(x, wg, wu, wd, sizes)) <= tol


@pytest.mark.parametrize("case", ["random_with_zeros", "one_expert_all_rows", "full_no_tail"])
def test_swiglu_blocks_gradients_equal_dense(case):
    """Training differentiates the blocked path: its gradients (inputs and every weight)
    equal those of the masked dense reference, which does the same math E x over."""
    sizes = jnp.asarray(GROUP_CASES[case], jnp.int32)
    rng = np.random.default_rng(4)
    d, f = 8, 6
    x = rng.standard_normal((M_ROWS, d)).astype(np.float32)
    ws = [(rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
          for shape in ((NUM_E, d, f), (NUM_E, d, f), (NUM_E, f, d))]
    probe = rng.standard_normal((M_ROWS, d)).astype(np.float32)

    def loss(fn):
        return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a, sizes) * probe), argnums=(0, 1, 2, 3)))

    blocked = loss(functools.partial(gg.swiglu_blocks, block_rows=4))(x, *ws)
    dense = loss(gg.swiglu_dense)(x, *ws)
    for got, want in zip(blocked, dense):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _plan_tiles(sizes, num_rows, tile_rows):
    starts = jnp.cumsum(sizes) - sizes
    max_tiles = -(-num_rows // tile_rows) + sizes.shape[0]
    plan = gg.plan_tiles(starts, sizes, max_tiles, tile_rows)  # not a pytree: unpack it
    return plan.num_tiles, plan.tile_group, plan.tile_start, plan.tile_end


def test_plan_tiles_by_hand():
    num_tiles, group, start, end = _plan_tiles(jnp.asarray([5, 0, 3], jnp.int32), 9, 4)
    assert int(num_tiles) == 3 and group.shape == (3 + 3,)  # ceil(9/4) + E slots
    np.testing.assert_array_equal(np.asarray(group)[:3], [0, 0, 2])
    np.testing.assert_array_equal(np.asarray(start)[:3], [0, 4, 5])
    np.testing.assert_array_equal(np.asarray(end)[:3], [5, 5, 8])


@pytest.mark.parametrize("tile_rows", [1, 3, 8])
def test_plan_tiles_invariants(tile_rows):
    num_groups, num_rows = 6, 40
    rng = np.random.default_rng(tile_rows)
    cases = [np.zeros(num_groups, int), np.array([0, 0, 40, 0, 0, 0]),
             np.array([40, 0, 0, 0, 0, 0]), np.array([0, 0, 0, 0, 0, 40])]
    while len(cases) < 12:
        sizes = rng.integers(0, 12, num_groups) * (rng.random(num_groups) < 0.7)
        if sizes.sum() <= num_rows:
            cases.append(sizes)
    max_tiles = -(-num_rows // tile_rows) + num_groups
    for sizes in cases:
        num_tiles, group, start, end = _plan_tiles(jnp.asarray(sizes, jnp.int32), num_rows,
                                                   tile_rows)
        assert group.shape == start.shape == end.shape == (max_tiles,)
        n = int(num_tiles)
        assert n == sum(-(-int(s) // tile_rows) for s in sizes) <= max_tiles
        group, start, end = np.asarray(group)[:n], np.asarray(start)[:n], np.asarray(end)[:n]
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        assert np.all(np.diff(group) >= 0), "tiles are in group order"
        assert set(group.tolist()) == {g for g in range(num_groups) if sizes[g] > 0}
        covered = []
        for g, s, e in zip(group, start, end):
            assert offsets[g] <= s < e == offsets[g + 1], "a tile lies inside one non-empty group"
            assert (s - offsets[g]) % tile_rows == 0
            covered.extend(range(s, min(s + tile_rows, e)))
        assert covered == list(range(int(sizes.sum()))), (sizes, "tiles cover routed rows once")


@pytest.mark.parametrize("full_rows,rest_rows", [(4, 1), (8, 3), (4, 4)])
def test_two_level_plan_covers_each_routed_row_once(full_rows, rest_rows):
    rng = np.random.default_rng(full_rows * 7 + rest_rows)
    num_rows = 50
    for _ in range(10):
        sizes = rng.integers(0, 14, 5) * (rng.random(5) < 0.8)
        if sizes.sum() > num_rows:
            continue
        plans = jax.jit(gg.plan_two_level, static_argnums=(1, 2, 3))(
            jnp.asarray(sizes, jnp.int32), num_rows, full_rows, rest_rows)
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        covered = []
        for plan, rows in zip(plans, (full_rows, rest_rows)):
            n = int(plan.num_tiles)
            assert n <= plan.tile_group.shape[0]
            for g, s, e in zip(*(np.asarray(a)[:n] for a in
                                 (plan.tile_group, plan.tile_start, plan.tile_end))):
                assert offsets[g] <= s < e <= offsets[g + 1]
                if rows == full_rows and full_rows != rest_rows:
                    assert s + rows <= e, "full tiles are never partial"
                covered.extend(range(s, min(s + rows, e)))
        assert sorted(covered) == list(range(int(sizes.sum()))), sizes


# ----------------------------------------------------------------------------- routing / block
T_TOK, D_MODEL, F_EXP, K_TOP = 11, 16, 16, 2   # d, f multiples of 16: Pallas on GPU needs it


def _moe_weights(seed: int = 0):
    rng = np.random.default_rng(seed)
    # ×4 router scale: well separated router logits, so float32 rounding cannot flip a choice.
    router = (rng.standard_normal((D_MODEL, NUM_E)) * 4 / np.sqrt(D_MODEL)).astype(np.float32)
    wg = (rng.standard_normal((NUM_E, D_MODEL, F_EXP)) / np.sqrt(D_MODEL)).astype(np.float32)
    wu = (rng.standard_normal((NUM_E, D_MODEL, F_EXP)) / np.sqrt(D_MODEL)).astype(np.float32)
    wd = (rng.standard_normal((NUM_E, F_EXP, D_MODEL)) / np.sqrt(F_EXP)).astype(np.float32)
    return router, wg, wu, wd


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_route_vs_numpy(norm_topk_prob):
    router, *_ = _moe_weights()
    x = np.random.default_rng(5).standard_normal((T_TOK, D_MODEL)).astype(np.float32)
    routing = moe.route(jnp.asarray(x), jnp.asarray(router), K_TOP, norm_topk_prob)
    weights, experts = np_route(x, router, K_TOP, norm_topk_prob)
    assert routing.experts.dtype == jnp.int32 and routing.weights.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(routing.experts), experts)
    np.testing.assert_allclose(np.asarray(routing.weights), weights, rtol=1e-5, atol=1e-6)
    sums = np.asarray(routing.weights).sum(-1)
    if norm_topk_prob:
        np.testing.assert_allclose(sums, 1.0, rtol=1e-6)
    else:
        assert np.all(sums < 1.0)


@functools.partial(jax.jit, static_argnames=("impl", "norm_topk_prob", "with_valid"))
def _moe_block(x, router, wg, wu, wd, valid, impl, norm_topk_prob, with_valid=True):
    """The MoE layer's stages on x [T, d]: route -> permute -> experts -> combine."""
    valid = valid if with_valid else None
    routing = moe.route(x, router, K_TOP, norm_topk_prob)
    perm = moe.permute(x, routing, wg.shape[0], valid)
    y_sorted = moe.expert_compute(perm, wg, wu, wd, impl=impl, tile_rows=4)
    return moe.combine(y_sorted, perm, routing, valid)


def test_every_expert_impl_but_auto_is_a_registered_kernel():
    assert set(moe.EXPERT_KERNELS) == set(moe.EXPERT_IMPLS) - {"auto"}
    assert set(moe.BIASED_IMPLS) <= set(moe.EXPERT_KERNELS)


@pytest.mark.parametrize("impl", sorted(moe.EXPERT_KERNELS))   # every kernel, by its name
def test_moe_block_padding(impl):
    router, wg, wu, wd = _moe_weights(1)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((T_TOK, D_MODEL)).astype(np.float32)
    valid = np.ones(T_TOK, bool)
    valid[[1, 4, 5, 10]] = False
    out = np.asarray(_moe_block(x, router, wg, wu, wd, valid, impl, True))
    # Padding rows come back as zeros.
    assert np.all(out[~valid] == 0.0)
    # Valid rows equal the MoE of the valid tokens alone (no padding, no mask; computed with
    # the fused path once, shared by all parametrizations) and the float64 reference.
    alone = np.asarray(_moe_block(x[valid], router, wg, wu, wd, valid[valid], "fused_tiles",
                                  True, with_valid=False))
    np.testing.assert_allclose(out[valid], alone, rtol=1e-5, atol=1e-6)
    assert rel_err(out[valid], np_moe(x[valid], router, wg, wu, wd, K_TOP, True)) <= 1e-5
    # Whatever the padding rows hold, the valid rows are unchanged.
    x2 = x.copy()
    x2[~valid] = rng.standard_normal((int((~valid).sum()), D_MODEL)) * 100
    out2 = np.asarray(_moe_block(x2, router, wg, wu, wd, valid, impl, True))
    np.testing.assert_array_equal(out2[valid], out[valid])
    assert np.all(out2[~valid] == 0.0)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_block_vs_numpy(norm_topk_prob):
    router, wg, wu, wd = _moe_weights(2)
    x = np.random.default_rng(8).standard_normal((T_TOK, D_MODEL)).astype(np.float32)
    out = _moe_block(x, router, wg, wu, wd, np.ones(T_TOK, bool), "fused_tiles", norm_topk_prob)
    ref = np_moe(x, router, wg, wu, wd, K_TOP, norm_topk_prob)
    assert rel_err(out, ref) <= 1e-5


def test_permute_groups_and_sentinel():
    router, *_ = _moe_weights(3)
    x = np.random.default_rng(9).standard_normal((T_TOK, D_MODEL)).astype(np.float32)
    valid = np.arange(T_TOK) % 3 != 0
    routing = moe.route(jnp.asarray(x), jnp.asarray(router), K_TOP, True)
    perm = moe.permute(jnp.asarray(x), routing, NUM_E, jnp.asarray(valid))
    experts = np.asarray(routing.experts)
    expected_sizes = np.bincount(experts[valid].reshape(-1), minlength=NUM_E)
    np.testing.assert_array_equal(np.asarray(perm.group_sizes), expected_sizes)
    order = np.asarray(perm.order)
    assert sorted(order.tolist()) == list(range(T_TOK * K_TOP))
    np.testing.assert_array_equal(np.asarray(perm.x_sorted), x[order // K_TOP])
    flat = np.where(np.repeat(valid, K_TOP), experts.reshape(-1), NUM_E)
    assert np.all(np.diff(flat[order]) >= 0), "rows sorted by expert, padding last"


def test_unknown_expert_impl_raises(typechecks_off):
    """The production error (under the tests' type checks the Literal hint would answer first)."""
    _, wg, wu, wd = _moe_weights()
    perm = moe.Permutation(x_sorted=np.zeros((4, D_MODEL), np.float32),
                           order=np.arange(4, dtype=np.int32),
                           group_sizes=np.array([4, 0, 0, 0, 0], np.int32))
    with pytest.raises(ValueError, match="unknown expert implementation 'nope'"):
        moe.expert_compute(perm, wg, wu, wd, impl="nope")


def test_a_layer_may_be_skipped_only_when_its_dispatch_does_not_communicate():
    """``MoEDispatcher.skippable``: a collective must run on every device alike, so only a
    dispatch whose source and transport both stay local may sit under a ``lax.cond``."""
    from moejax import dispatch
    from moejax.backends.sync_ep import AllToAllTokens
    from moejax.backends.streamed import GatheredFromWindow

    stacked, given = dispatch.StackedExperts({}), dispatch.GivenExperts({})
    ahead = dispatch.GatheredAhead({}, {}, "ep", NUM_E, 2)
    local, tp = dispatch.LocalTokens(NUM_E), dispatch.LocalTokens(NUM_E, psum_axis="tp")
    assert dispatch.MoEDispatcher(stacked, local).skippable
    assert dispatch.MoEDispatcher(given, local).skippable
    assert not dispatch.MoEDispatcher(stacked, tp).skippable
    assert not dispatch.MoEDispatcher(ahead, local).skippable
    assert not dispatch.MoEDispatcher(GatheredFromWindow({}, {}, "ep", NUM_E, 2), local).skippable
    assert not dispatch.MoEDispatcher(stacked, AllToAllTokens(ctx=None, capacity=1)).skippable

