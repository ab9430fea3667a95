"""The engine core: what runs requests on the devices, below the front door (``serving``).

* ``scoring_engine`` — one device group's scoring engine: packs prefill ops, runs the
  backend's steps, and reuses prompt blocks through the prefix pool (``prefix_plan``).
* ``engine_pool`` and ``router`` — data-parallel scoring engines behind the prefix-,
  FLOP- and saturation-aware router (DESIGN.md, Algorithm 1).
* ``continuous`` — continuous batching of generation over a decode runner
  (``moejax.decode``); ``decoders`` — a prefill engine handing prompts to decoders.

Every KV pool is a ``moejax.kv.KVPool`` whose blocks a ``moejax.kv.BlockAllocator`` keeps;
a device's pool and allocator form one ``moejax.kv.KVStore``, which a scoring engine and a
continuous scheduler on the same device share.
"""
