"""Bytes a compiled program moves between devices, counted from its optimized HLO.

Why: the MoE-Prefill paper's Table 1 (bytes each strategy moves per device per layer)
is a set of formulas; what a backend really moves depends on the program XLA built from
it (padding to a capacity, a gather XLA inserted, a collective the partitioner added).
Counting the compiled program's collectives gives the figure the program pays, which a
benchmark can put beside the formula.

What is counted, per device and per run of the program, for each collective of the
optimized HLO (synchronous forms, and the ``-done`` halves of asynchronous ones): the
bytes that leave the device, under the usual ring / direct algorithms, for a group of G:

* ``all-gather``: (G-1)/G of the gathered result (every other device's shard comes in,
  as much goes out);
* ``all-to-all``: (G-1)/G of the exchanged buffers (one G-th stays home);
* ``all-reduce``: 2 (G-1)/G of the buffer (a ring's reduce-scatter then all-gather);
* ``reduce-scatter``: (G-1) times the result (the input is G results);
* ``collective-permute``: the whole buffer.

A collective inside a ``while`` runs as often as the loop's trip count. XLA records the
count when it can prove it (``known_trip_count``, as for a layer loop); a collective in
a loop whose count XLA does not know cannot be counted, and :func:`collectives` raises
:class:`UncountableProgram` saying which loop.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Iterable, Mapping

DTYPE_BYTES: Mapping[str, float] = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
    "f8e4m3b11fnuz": 1, "f4e2m1fn": 0.5,
}
KINDS = ("all-gather", "all-to-all", "all-reduce", "reduce-scatter", "collective-permute")

_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((%[\w.\-]+)?")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_CALLED = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)"
                     r"=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[\d,]*\})")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")


class UncountableProgram(ValueError):
    """A collective sits in a loop whose trip count XLA does not know."""


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a program: its kind, the bytes of its result on one device, the
    size of its device group, and how many times one run of the program executes it."""

    kind: str
    result_bytes: float
    group_size: int
    executions: int

    @property
    def bytes_sent(self) -> float:
        """Bytes leaving one device, over all executions (module docstring)."""
        g, r = self.group_size, self.result_bytes
        if g <= 1 and self.kind != "collective-permute":
            return 0.0
        per_run = {"all-gather": (g - 1) / g * r, "all-to-all": (g - 1) / g * r,
                   "all-reduce": 2 * (g - 1) / g * r, "reduce-scatter": (g - 1) * r,
                   "collective-permute": r}[self.kind]
        return per_run * self.executions


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes one device moves: on the critical path (the computation waits for them) and in
    the background (overlapped with computation: prefetching gathers, host copies)."""

    critical: float = 0.0
    background: float = 0.0

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(self.critical + other.critical, self.background + other.background)

    def times(self, factor: float) -> "Traffic":
        return Traffic(self.critical * factor, self.background * factor)

    @property
    def total(self) -> float:
        return self.critical + self.background


def array_bytes(shape_text: str) -> float:
    """Bytes of an HLO result type: ``f32[8,32]{1,0}`` or a tuple of such."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape_text):
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown HLO element type {dtype!r} in {shape_text!r}")
        total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _group_size(line: str, num_devices: int) -> int:
    if (iota := _GROUPS_IOTA.search(line)) is not None:
        return int(iota.group(2))
    if (listed := _GROUPS_LIST.search(line)) is not None:
        members = [m for m in listed.group(1).strip("{}").split(",") if m]
        return len(members) or num_devices
    return num_devices                       # no groups: every device of the program


def _split_computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    bodies: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header is not None and current is None:
            current = header.group(2)
            bodies[current] = []
            if header.group(1):
                entry = current
        elif line.strip() == "}" and current is not None:
            current = None
        elif current is not None:
            bodies[current].append(line)
    if not entry:
        raise ValueError("not an HLO module: no ENTRY computation")
    return bodies, entry


def _trip_count(line: str) -> int | None:
    match = re.search(r"backend_config=(\{.*\})\s*$", line)
    if match is None:
        return None
    try:
        config = json.loads(match.group(1))
    except json.JSONDecodeError:
        return None
    known = config.get("known_trip_count")
    return None if known is None else int(known["n"])


def _run_counts(bodies: Mapping[str, list[str]], entry: str
                ) -> tuple[dict[str, int], dict[str, str]]:
    """How many times one run of the program runs each computation reachable from
    ``entry``, and for those inside a loop of unknown trip count, that loop's line."""
    runs: dict[str, int] = {}
    uncounted: dict[str, str] = {}
    stack: list[tuple[str, int, str | None]] = [(entry, 1, None)]
    while stack:
        name, times, loop = stack.pop()
        runs[name] = runs.get(name, 0) + times
        if loop is not None:
            uncounted.setdefault(name, loop)
        for line in bodies.get(name, ()):
            called = {callee: role for role, callee in _CALLED.findall(line)}
            for group in _BRANCHES.findall(line):
                called.update((callee, "branch") for callee in re.findall(r"%([\w.\-]+)", group))
            trips = _trip_count(line) if called and " while(" in line else None
            for callee, role in called.items():
                if role == "body":
                    inner = loop if trips is not None else (loop or line.strip()[:160])
                    stack.append((callee, times * (trips or 1), inner))
                elif role != "condition":
                    stack.append((callee, times, loop))
    return runs, uncounted


def collectives(hlo_text: str, num_devices: int) -> list[Collective]:
    """Every collective of an optimized HLO module (``compiled.as_text()``), with how often
    one run executes it. ``num_devices``: the program's device count (a collective without
    replica groups spans them all)."""
    bodies, entry = _split_computations(hlo_text)
    runs, uncounted = _run_counts(bodies, entry)
    found = []
    for name, lines in bodies.items():
        if runs.get(name, 0) == 0:
            continue
        parsed = [(m, line) for line in lines if (m := _INSTRUCTION.match(line)) is not None]
        defined = {m.group(1): line for m, line in parsed}
        for match, line in parsed:
            _, shape, op, operand = match.groups()
            kind = op[:-len("-done")] if op.endswith("-done") else op
            if kind not in KINDS:
                continue
            if op.endswith("-done") and operand:
                # The groups are written on the -start half, the received bytes on this one.
                line = defined.get(operand.lstrip("%"), line)
            if name in uncounted:
                raise UncountableProgram(
                    f"a {kind} in computation {name!r} runs inside a loop whose trip count "
                    f"XLA does not know: {uncounted[name]}")
            found.append(Collective(kind, array_bytes(shape), _group_size(line, num_devices),
                                    runs[name]))
    return found


def program_traffic(hlo_text: str, num_devices: int,
                    overlapped: Iterable[str] = ()) -> Traffic:
    """The bytes one device moves in one run of a compiled program: collectives of the
    kinds in ``overlapped`` are background (a backend that prefetches by them says so),
    the rest critical."""
    background = frozenset(overlapped)
    unknown = background - set(KINDS)
    if unknown:
        raise ValueError(f"unknown collective kinds {sorted(unknown)}; known: {KINDS}")
    traffic = Traffic()
    for c in collectives(hlo_text, num_devices):
        part = Traffic(background=c.bytes_sent) if c.kind in background else \
            Traffic(critical=c.bytes_sent)
        traffic = traffic + part
    return traffic


__all__ = ("Collective", "KINDS", "Traffic", "UncountableProgram", "array_bytes",
           "collectives", "program_traffic")
