"""Chained block hashes of token prefixes: the names of prefix KV blocks.

A prefill op (``moejax.ops.PrefillOp``) hashes its blocks once with this scheme; the router
and every engine's prefix cache then read those same digests.

A prompt is cut into blocks of ``BLOCK_SIZE`` tokens; block i gets the digest

    h_i = blake2b(h_{i-1} || token ids of block i as little-endian int32),  h_{-1} = ROOT_HASH

so two requests share ``h_i`` exactly when their first ``(i+1)·BLOCK_SIZE`` tokens are equal
(DESIGN.md "Formulas the seed text lost"). Only full blocks are hashed: a partial last block is
never cached, so it needs no name. The digest is keyed by a fixed personalisation string and
never uses Python's ``hash()``, so values agree across processes, hosts and runs — the router
(one process) and every engine's prefix cache (others) must name blocks identically.

API::

    block_hashes(token_ids, block_size=BLOCK_SIZE, parent=ROOT_HASH) -> list[bytes]
    block_hash(parent, block_token_ids) -> bytes
    num_full_blocks(num_tokens, block_size=BLOCK_SIZE) -> int

``parent`` continues a chain: hashing ``tokens[:32]`` and then ``tokens[32:]`` with
``parent=<last hash of the first call>`` gives the same list as hashing ``tokens`` at once
(when the split is block aligned).
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

BLOCK_SIZE = 16
DIGEST_SIZE = 16
# Changing either constant renames every block: bump the version suffix if the scheme changes.
HASH_PERSON = b"moejax.prefix.v1"
ROOT_HASH = bytes(DIGEST_SIZE)

_INT32_MAX = 2**31 - 1
# A pre-keyed hasher: copying it is ~3x cheaper than building blake2b(..., person=...) anew.
_TEMPLATE = hashlib.blake2b(digest_size=DIGEST_SIZE, person=HASH_PERSON)

TokenIds = Sequence[int] | np.ndarray


def num_full_blocks(num_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """How many whole blocks ``num_tokens`` tokens fill (the partial tail is not counted)."""
    _check_block_size(block_size)
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return num_tokens // block_size


def block_hash(parent: bytes, block_token_ids: TokenIds) -> bytes:
    """Digest of one block given the digest of the block before it (``ROOT_HASH`` for the first)."""
    _check_parent(parent)
    hasher = _TEMPLATE.copy()
    hasher.update(parent)
    hasher.update(_token_bytes(block_token_ids))
    return hasher.digest()


def block_hashes(token_ids: TokenIds, block_size: int = BLOCK_SIZE,
                 parent: bytes = ROOT_HASH) -> list[bytes]:
    """One chained digest per full block of ``token_ids``, in order.

    ``token_ids``: a sequence or 1-D array of non-negative ids below 2**31. ``parent``: the
    digest of the block preceding ``token_ids`` (``ROOT_HASH`` when they start the prompt).
    """
    _check_block_size(block_size)
    _check_parent(parent)
    data = _token_bytes(token_ids)
    width = 4 * block_size
    end = len(data) - len(data) % width
    out: list[bytes] = []
    append, copy = out.append, _TEMPLATE.copy   # bound once: this loop runs per request
    prev = parent
    for start in range(0, end, width):
        hasher = copy()
        hasher.update(prev)
        hasher.update(data[start:start + width])
        prev = hasher.digest()
        append(prev)
    return out


def _token_bytes(token_ids: TokenIds) -> bytes:
    """The ids as little-endian int32 bytes (the platform-independent form that is hashed)."""
    array = np.asarray(token_ids)
    if array.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional, got shape {array.shape}")
    if array.size and array.dtype != np.int32:
        if not np.issubdtype(array.dtype, np.integer):
            raise TypeError(f"token_ids must be integers, got dtype {array.dtype}")
        # Checked before the cast because astype would wrap out-of-range ids silently.
        if int(array.min()) < 0 or int(array.max()) > _INT32_MAX:
            raise ValueError("token ids must lie in [0, 2**31)")
    elif array.size and int(array.min()) < 0:
        raise ValueError("token ids must lie in [0, 2**31)")
    return array.astype("<i4", copy=False).tobytes()


def _check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")


def _check_parent(parent: bytes) -> None:
    if not isinstance(parent, bytes) or len(parent) != DIGEST_SIZE:
        raise ValueError(f"parent must be a {DIGEST_SIZE}-byte digest")
