"""The jaxtyping shape annotations are checked (by beartype) under the tests.

tests/conftest.py installs jaxtyping's import hook for ``TYPECHECKED_MODULES`` before any
test module imports them; these tests make sure that the hook is in effect and that it
rejects wrong shapes and dtypes, eagerly and while ``jax.jit`` traces.
"""

from __future__ import annotations

import importlib
import sys

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest

from kernels_pallas import metro
from moejax import attention, grouped_gemm
from moejax.static import cache as kv_cache

CONFTEST = sys.modules["conftest"]
pytestmark = pytest.mark.skipif(jaxtyping.config.jaxtyping_disable,
                                reason="JAXTYPING_DISABLE is set: the checks are off")


@pytest.mark.parametrize("name", CONFTEST.TYPECHECKED_MODULES)
def test_every_listed_module_is_instrumented(name):
    module = importlib.import_module(name)
    # The hook's loader rewrites the module (a jaxtyped decorator on every function and
    # dataclass); a module imported before conftest installed the hook has the plain one.
    assert type(module.__spec__.loader).__name__ == "_JaxtypingLoader", name


def operands(rows=8, d=16, f=32, experts=4):
    x = jnp.ones((rows, d), jnp.float32)
    w = jnp.ones((experts, d, f), jnp.float32)
    sizes = jnp.array([3, 0, 2, 1], jnp.int32)[:experts]
    return x, w, sizes


def test_a_right_call_returns_its_value():
    x, w, sizes = operands()
    out = grouped_gemm.gmm(x, w, sizes, tile_rows=4)
    assert out.shape == (8, 32)
    np.testing.assert_allclose(np.asarray(out)[:6], 16.0)
    np.testing.assert_array_equal(np.asarray(out)[6:], 0.0)


def test_wrong_shapes_are_rejected():
    x, w, sizes = operands()
    with pytest.raises(jaxtyping.TypeCheckError, match="rhs"):      # d differs: 16 vs 8
        grouped_gemm.gmm(x, jnp.ones((4, 8, 32)), sizes)
    with pytest.raises(jaxtyping.TypeCheckError, match="group_sizes"):   # E: 4 vs 3
        grouped_gemm.gmm(x, w, sizes[:3])
    with pytest.raises(jaxtyping.TypeCheckError, match="lhs"):      # rank
        grouped_gemm.gmm(x[0], w, sizes)
    q = jnp.zeros((8, 4, 16))
    k = jnp.zeros((8, 2, 16))
    with pytest.raises(jaxtyping.TypeCheckError, match="lengths"):  # B: 8 vs 3
        kv_cache.attend_cache(q, k[None].repeat(8, 0), k[None].repeat(8, 0),
                              jnp.ones(3, jnp.int32))


def test_wrong_dtypes_are_rejected():
    x, w, sizes = operands()
    with pytest.raises(jaxtyping.TypeCheckError, match="group_sizes"):
        grouped_gemm.gmm(x, w, sizes.astype(jnp.float32))
    with pytest.raises(jaxtyping.TypeCheckError, match="lhs"):
        grouped_gemm.gmm(x.astype(jnp.int32), w, sizes)


def test_dataclass_fields_are_checked():
    # when the dataclass is built (JAX builds pytree dataclasses too, from tracers under jit)
    with pytest.raises(jaxtyping.TypeCheckError):
        # (keys and values may differ in their last dim, for MLA, but not in their heads)
        kv_cache.KVCache(keys=jnp.zeros((1, 2, 4, 1, 8)), values=jnp.zeros((1, 2, 4, 2, 8)))


def test_plain_hints_are_checked_with_the_numeric_tower():
    with pytest.raises(jaxtyping.TypeCheckError, match="attn_block"):
        attention.segment_bias(jnp.zeros(8, jnp.int32), 4.0)      # attn_block: int
    # an int where the hint says float passes (PEP 484), as for static checkers
    np.testing.assert_array_equal(metro.eplb_replica_counts([8, 4, 2, 2], 4, 8), [4, 2, 1, 1])


def test_host_functions_take_numpy_and_jax_arrays():
    segments = np.array([0, 0, 1, 1, 1, -1, -1, -1], np.int32)
    from_numpy = attention.segment_bias(segments, 4)
    from_jax = attention.segment_bias(jnp.asarray(segments), 4)
    np.testing.assert_array_equal(np.asarray(from_numpy), np.asarray(from_jax))
    placement = np.array([[1, 1], [1, 0]], bool)
    for tokens in (np.array([3, 1]), jnp.array([3, 1])):
        np.testing.assert_array_equal(metro.route_metro_reference(placement, tokens), [1, 0])


def test_checks_run_on_tracers_while_jit_traces():
    """Shapes are static under jit, so the check runs (once) when the function is traced:
    a wrong call fails at trace time, and calls served by the compile cache cost nothing."""
    seen = []

    @jax.jit
    def run(q, k, v, segment_ids):
        seen.append(q)
        return attention.packed_attention(q, k, v, segment_ids, 4)

    q, kv, seg = jnp.zeros((8, 4, 16)), jnp.zeros((8, 2, 16)), jnp.zeros(8, jnp.int32)
    assert run(q, kv, kv, seg).shape == (8, 4, 16)
    assert isinstance(seen[0], jax.core.Tracer) and isinstance(seen[0], jax.Array)
    assert run(q, kv, kv, seg).shape == (8, 4, 16) and len(seen) == 1   # cached: no check
    with pytest.raises(jaxtyping.TypeCheckError, match="'k'"):      # h: 16 vs 8
        run(q, jnp.zeros((8, 2, 8)), kv, seg)
    with pytest.raises(jaxtyping.TypeCheckError, match="segment_ids"):   # float ids
        run(q, kv, kv, seg.astype(jnp.float32))


def test_validation_tests_can_switch_the_checks_off(typechecks_off):
    # what production does: no hint is checked, the function's own ValueError speaks
    with pytest.raises(ValueError, match="2-D"):
        metro.tokens_per_expert(np.array([0, 1]), 3)
