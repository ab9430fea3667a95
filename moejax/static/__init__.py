"""The static-batching generation runtime (``Generator(batching="static")``): each batch
prefills into a dense ``[L, B, S, n_kv, h]`` KV cache of its own and decodes to the end
of its longest request. It keeps no pool and shares nothing with the engine core; it is
the baseline continuous batching is measured against and a reference the paged runtime's
tests compare with.

* :mod:`moejax.static.cache` — the dense cache, attention over it, its attention kinds;
* :mod:`moejax.static.decode` — :class:`~moejax.static.decode.DecodeEngine`, the loop.
"""
