"""Proof that async_ep's weight all-gather can overlap the layer's compute.

CPU (collectives are synchronous there): the program handed to XLA issues layer l+1's
all-gathers before any of layer l's matmuls in the scanned layer body.
GPU: the compiled, scheduled HLO holds ``all-gather-start`` … a matmul …
``all-gather-done`` in one computation (the latency-hiding scheduler placed the
layer's compute inside the collective's window).
"""

from __future__ import annotations

import re

import jax
import pytest

from backend_fixtures import small_workload
from moejax.backends import make_backend
from moejax.backends.base import padded_step


@pytest.fixture(scope="module")
def lowered():
    if jax.default_backend() != "cpu" and len(jax.devices()) < 2:
        pytest.skip("async_ep's all-gather needs at least 2 devices of this backend")
    work = small_workload(shapes=1)
    devices = min(2, len(jax.devices()))
    backend = make_backend("async_ep", work.cfg, work.params, devices=devices)
    host = work.hosts[0]
    (lowered,) = backend.lowered_steps(padded_step([host.batch], backend.num_ranks),
                                       host.options)
    return lowered


def functions(stablehlo: str) -> list[str]:
    """The text of each func.func of a StableHLO module."""
    starts = [m.start() for m in re.finditer(r"^\s*func\.func", stablehlo, re.M)]
    return [stablehlo[a:b] for a, b in zip(starts, starts[1:] + [len(stablehlo)])]


def test_layer_body_issues_the_gather_before_its_matmuls(lowered):
    bodies = [f for f in functions(lowered.as_text()) if "stablehlo.all_gather" in f]
    assert bodies, "no function of the async_ep program all-gathers"
    for body in bodies:
        first_gather = body.index("stablehlo.all_gather")
        first_matmul = body.index("stablehlo.dot_general")
        assert first_gather < first_matmul
        # one gather per expert weight (gate, up, down), all before the compute
        assert body[:first_matmul].count("stablehlo.all_gather") == 3


def scheduled_computations(hlo: str) -> dict[str, list[str]]:
    """Instruction lines of each computation of an optimized HLO module, in schedule order."""
    out, name = {}, None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if header and not line.startswith(" "):
            name = header.group(1)
            out[name] = []
        elif name and line.startswith("  "):
            out[name].append(line.strip())
    return out


MATMUL = re.compile(r"custom-call.*(gemm|matmul|triton)|= \S+ dot\(|fusion.*kind=kCustom")


@pytest.mark.gpu
def test_gpu_schedule_puts_compute_between_gather_start_and_done(lowered):
    hlo = lowered.compile().as_text()
    assert "all-gather-start" in hlo, "the all-gather was not made asynchronous"
    overlapped = False
    for lines in scheduled_computations(hlo).values():
        starts = [i for i, line in enumerate(lines) if "all-gather-start" in line]
        dones = [i for i, line in enumerate(lines) if "all-gather-done" in line]
        matmuls = [i for i, line in enumerate(lines) if MATMUL.search(line)]
        if starts and dones and any(min(starts) < m < max(dones) for m in matmuls):
            overlapped = True
    assert overlapped, "no matmul is scheduled between all-gather-start and all-gather-done"
