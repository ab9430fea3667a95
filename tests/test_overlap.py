"""Proof that async_ep's and hybrid's weight all-gather can overlap the layer's compute.

CPU (collectives are synchronous there): in the program handed to XLA, the layer body
(async_ep: the fused layer loop; hybrid: its per-layer program, whose next layer's shards
came from host memory) issues one all-gather per expert weight of layer l+1, and they
depend on nothing layer l computes (only the local shards and the layer index), so the
scheduler is free to start them before any of the layer's matmuls.
GPU (marked ``gpu``; needs 2 or more GPUs: the lent machines have one): the compiled,
scheduled HLO holds ``all-gather-start`` … a matmul … ``all-gather-done`` in one
computation (the latency-hiding scheduler placed the layer's compute inside the
collective's window). Compiling the 8-GPU program on a machine without GPUs
(deviceless, ahead of time) is not possible with the installed JAX 0.10.2:
``jax.experimental.topologies.get_topology_desc(platform="cuda")`` raises "topology not
implemented for cuda" without the CUDA plugin, and with ``jax-cuda12-pjrt`` 0.10.2
installed the plugin refuses to start without the CUDA runtime libraries ("Unable to
load CUDA"), and a CUDA topology needs a target description of a real GPU
(``docs/PERF.md``, "Issue 39").
"""

from __future__ import annotations

import re

import jax
import pytest

from backend_fixtures import small_workload
from moejax.backends import make_backend
from moejax.backends.base import padded_step


@pytest.fixture(scope="module", params=["async_ep", "hybrid"])
def lowered(request):
    """async_ep's step, or hybrid's layer program (its first: the last gathers nothing)."""
    if jax.default_backend() != "cpu" and len(jax.devices()) < 2:
        pytest.skip(f"{request.param}'s all-gather needs at least 2 devices of this backend")
    work = small_workload(shapes=1)
    devices = min(2, len(jax.devices()))
    backend = make_backend(request.param, work.cfg, work.params, devices=devices)
    host = work.hosts[0]
    programs = backend.lowered_steps(padded_step([host.batch], backend.num_ranks),
                                     host.options)
    return programs[0]


def functions(stablehlo: str) -> list[str]:
    """The text of each func.func of a StableHLO module."""
    starts = [m.start() for m in re.finditer(r"^\s*func\.func", stablehlo, re.M)]
    return [stablehlo[a:b] for a, b in zip(starts, starts[1:] + [len(stablehlo)])]


SSA_DEF = re.compile(r"^\s*(%[\w.\-#:]+(?:\s*,\s*%[\w.\-#:]+)*)\s*=\s*(.*)$")
SSA_USE = re.compile(r"%[\w.\-]+")
CALLEE = re.compile(r"call @([\w.\-]+)")


def definitions(function: str) -> dict[str, str]:
    """SSA name -> the line defining it, in one function (``%a:3`` and ``%a#1`` -> ``%a``)."""
    out = {}
    for line in function.splitlines():
        match = SSA_DEF.match(line)
        if match:
            for name in match.group(1).split(","):
                out[name.strip().split(":")[0].split("#")[0]] = match.group(2)
    return out


def upstream(value: str, defs: dict[str, str]) -> list[str]:
    """The defining lines of everything ``value`` is computed from, in its function."""
    seen, stack, lines = set(), [value], []
    while stack:
        name = stack.pop()
        if name in seen or name not in defs:     # function arguments have no definition
            continue
        seen.add(name)
        lines.append(defs[name])
        stack.extend(use.split("#")[0] for use in SSA_USE.findall(defs[name]))
    return lines


def test_layer_body_gathers_the_next_layer_independently_of_its_compute(lowered):
    text = lowered.as_text()
    by_name = {m.group(1): f for f in functions(text)
               if (m := re.search(r"func\.func \w+ @([\w.\-]+)", f))}
    bodies = [f for f in by_name.values() if "stablehlo.all_gather" in f]
    assert bodies, "no function of the async_ep program all-gathers"
    for body in bodies:
        assert "stablehlo.dot_general" in body, "the gathers are not in a layer body"
        defs = definitions(body)
        gathers = [line for line in body.splitlines() if "stablehlo.all_gather" in line]
        # one gather per expert weight (gate, up, down)
        assert len(gathers) == 3
        for line in gathers:
            operand = SSA_USE.findall(line.split("=", 1)[1])[0]
            for source in upstream(operand, defs):
                callee = CALLEE.search(source)
                computed = by_name.get(callee.group(1), "") if callee else source
                assert "dot_general" not in computed, (
                    f"the all-gather waits for the layer's compute: {source.strip()[:120]}")


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
