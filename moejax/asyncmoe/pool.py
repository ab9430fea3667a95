"""The token pool (seed §3.2, "Top-K support"): holds the k expert outputs of a token
until all have arrived, so that nothing downstream sees a partial top-k merge.

Parts are keyed by (request_id, step, layer) and told apart by ``slot`` (the position in
the token's top-k). They may arrive in any order and interleaved with other tokens'
parts. The pool only groups: summing weight · output (+ residual) is the driver's, on
whatever the payloads are. Nothing is dropped silently: a part that cannot belong to a
k-way merge raises.
"""

from __future__ import annotations

from moejax.asyncmoe.records import EXPERT, TokenKey, TokenRecord, token_key


class TokenPool:
    """Incomplete top-k merges of the requests on one attention rank."""

    def __init__(self, k: int) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"TokenPool: k (top-k) must be an int >= 1, got {k!r}")
        self.k = k
        self._parts: dict[TokenKey, dict[int, TokenRecord]] = {}

    def add(self, record: TokenRecord) -> list[TokenRecord] | None:
        """Add one expert output. Returns the token's k parts ordered by slot once the
        k-th arrives (the token leaves the pool), else None.

        Raises ValueError, naming the (request_id, step, layer) key, for a record that
        is not of kind "expert", a slot outside [0, k), a slot that already arrived, or
        a part whose rank or context disagrees with the parts already held."""
        key = token_key(record)
        if record.kind != EXPERT:
            raise ValueError(f"token pool {key}: only expert outputs are merged, got a "
                             f"{record.kind!r} record")
        if not 0 <= record.slot < self.k:
            raise ValueError(f"token pool {key}: slot {record.slot} outside [0, {self.k})")
        parts = self._parts.setdefault(key, {})
        if record.slot in parts:
            raise ValueError(f"token pool {key}: slot {record.slot} arrived twice (expert "
                             f"{parts[record.slot].expert}, then expert {record.expert})")
        if parts:
            first = next(iter(parts.values()))
            if (first.rank, first.context) != (record.rank, record.context):
                raise ValueError(f"token pool {key}: slot {record.slot} has rank "
                                 f"{record.rank}, context {record.context}; earlier parts "
                                 f"have rank {first.rank}, context {first.context}")
        parts[record.slot] = record
        if len(parts) < self.k:
            return None
        del self._parts[key]
        return [parts[slot] for slot in range(self.k)]

    def pending(self) -> int:
        """The number of tokens with some but not all k parts held."""
        return len(self._parts)

    def pending_keys(self) -> list[TokenKey]:
        """Those tokens' keys, in the order their first part arrived."""
        return list(self._parts)
