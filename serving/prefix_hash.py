"""Chained block hashes of token prefixes — re-exported from :mod:`moejax.prefix_hash`.

The scheme lives in ``moejax/`` because the prefill-op record (``moejax.ops.PrefillOp``)
hashes its own blocks and ``moejax`` never imports ``serving``; this module keeps the
serving-side import path (router, prefix cache, benchmarks) working.
"""

from moejax.prefix_hash import (BLOCK_SIZE, DIGEST_SIZE, HASH_PERSON, ROOT_HASH, TokenIds,
                                block_hash, block_hashes, num_full_blocks)

__all__ = ["BLOCK_SIZE", "DIGEST_SIZE", "HASH_PERSON", "ROOT_HASH", "TokenIds", "block_hash",
           "block_hashes", "num_full_blocks"]
