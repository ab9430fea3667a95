"""The metadata of one token on its way through AsyncMoE's layers (the seed's Table 1).

A :class:`TokenRecord` is what every queue, the token pool and the communicator pass
around; its tensor data is the opaque ``payload`` (a device array in a real runtime,
``None`` in the simulator), so nothing here knows how layers are computed.

Kinds and the queue ("μ-queue") a record waits in, ``queue_key(record) = (layer, unit)``:

* ``"attention"``: the input of attention block ``layer`` on the request's rank
  (unit :data:`ATTENTION_UNIT` = -1). Attention includes the top-k merge of the
  previous block's expert outputs and this block's gate (seed §3.1);
* ``"expert"``: one of the k copies of a token, for expert ``expert`` of block
  ``layer`` (unit = the expert id). The same kind carries that expert's *output* back
  to the request's rank, where the token pool merges the k copies; which of the two a
  record is follows from the entry point it is handed to (``DeviceEngine.enqueue`` for
  inputs, ``DeviceEngine.receive`` for outputs), not from a field;
* ``"head"``: a token whose last block is merged, waiting for the final norm, LM head and
  sampler on its rank (unit :data:`HEAD_UNIT` = -2, ``layer`` = the last block). The
  head is a schedulable unit like any other (the seed's sampler "is treated equivalently
  to other attention layers and must be scheduled"); its batch completes the decode
  step's token.

``step`` is the request's decode step (0-based): step s feeds the request's newest token
through all blocks and the head samples the next one, so a request with D decode tokens
runs steps 0..D-1. ``context`` is the number of tokens in the request's KV cache once
this token's own key/value is written: ``prompt_length + step + 1`` (the prompt, the
``step`` earlier decode tokens, this one). It is the same at every block and is what
attention's cost depends on.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

ATTENTION = "attention"
EXPERT = "expert"
HEAD = "head"
KINDS = (ATTENTION, EXPERT, HEAD)

ATTENTION_UNIT = -1
"""The queue column (unit id) of a device's attention rank."""
HEAD_UNIT = -2
"""The queue column (unit id) of a device's LM head + sampler."""
NO_EXPERT = -1
"""``expert`` of a record that is not for an expert."""
NO_SLOT = -1
"""``slot`` of a record that is not one of the k copies."""

TokenKey = tuple[int, int, int]
"""(request_id, step, layer): one token at one block; the token pool's key."""
QueueKey = tuple[int, int]
"""(layer, unit): one μ-queue."""


def _check_int(name: str, value: Any, minimum: int) -> None:
    if type(value) is not int or value < minimum:  # a bool or a NumPy int is refused
        raise ValueError(f"TokenRecord.{name} must be an int >= {minimum}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class TokenRecord:
    """One token's metadata (module docstring). ``payload`` is excluded from equality
    and hashing: it is opaque (a device array compares element-wise).

    Attention and head records have ``expert`` = -1, ``slot`` = -1, ``weight`` = 0;
    expert records have ``expert`` >= 0, ``slot`` in [0, k) (which of the token's k
    copies: the position in its top-k) and ``weight``, the top-k gate weight."""

    request_id: int
    step: int
    layer: int
    kind: str
    expert: int
    rank: int
    context: int
    slot: int
    weight: float
    payload: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"TokenRecord.kind must be one of {KINDS}, got {self.kind!r}")
        for name in ("request_id", "step", "layer", "rank"):
            _check_int(name, getattr(self, name), 0)
        _check_int("context", self.context, 1)
        if type(self.weight) is bool or not isinstance(self.weight, (int, float)) \
                or not math.isfinite(self.weight):
            raise ValueError(f"TokenRecord.weight must be a finite float, got {self.weight!r}")
        if self.kind == EXPERT:
            _check_int("expert", self.expert, 0)
            _check_int("slot", self.slot, 0)
        elif (self.expert, self.slot, self.weight) != (NO_EXPERT, NO_SLOT, 0):
            raise ValueError(f"a {self.kind} record has expert={NO_EXPERT}, slot={NO_SLOT}, "
                             f"weight=0; got expert={self.expert!r}, slot={self.slot!r}, "
                             f"weight={self.weight!r} for request {self.request_id} step "
                             f"{self.step} layer {self.layer}")

    def describe(self) -> str:
        """A short name for error messages: kind, request, step, layer (and expert/slot)."""
        where = f" expert {self.expert} slot {self.slot}" if self.kind == EXPERT else ""
        return (f"{self.kind} record of request {self.request_id} step {self.step} "
                f"layer {self.layer}{where} (rank {self.rank})")


def unit_of(record: TokenRecord) -> int:
    """The queue column a record waits in: -1 attention, -2 head, else its expert id."""
    if record.kind == ATTENTION:
        return ATTENTION_UNIT
    if record.kind == HEAD:
        return HEAD_UNIT
    return record.expert


def queue_key(record: TokenRecord) -> QueueKey:
    """(layer, unit): the μ-queue of ``record``."""
    return record.layer, unit_of(record)


def token_key(record: TokenRecord) -> TokenKey:
    """(request_id, step, layer): the token ``record`` is (a copy of)."""
    return record.request_id, record.step, record.layer


def unit_kind(unit: int) -> str:
    """The record kind a queue column holds: "attention" (-1), "head" (-2), "expert" (>= 0)."""
    if isinstance(unit, bool) or not isinstance(unit, int) or unit < HEAD_UNIT:
        raise ValueError(f"a unit id is {ATTENTION_UNIT} (attention), {HEAD_UNIT} (head) or "
                         f"an expert id >= 0, got {unit!r}")
    if unit == ATTENTION_UNIT:
        return ATTENTION
    if unit == HEAD_UNIT:
        return HEAD
    return EXPERT


def attention_record(request_id: int, step: int, layer: int, rank: int, context: int,
                     payload: Any = None) -> TokenRecord:
    """The input of attention block ``layer`` for one token of a request on ``rank``."""
    return TokenRecord(request_id, step, layer, ATTENTION, NO_EXPERT, rank, context, NO_SLOT,
                       0.0, payload)


def head_record(request_id: int, step: int, layer: int, rank: int, context: int,
                payload: Any = None) -> TokenRecord:
    """A token whose last block (``layer``) is merged, for the LM head + sampler."""
    return TokenRecord(request_id, step, layer, HEAD, NO_EXPERT, rank, context, NO_SLOT,
                       0.0, payload)
