"""moejax: prefill-only Mixture-of-Experts serving in JAX.

``moejax.Scorer`` is ``serving.Scorer`` and ``moejax.Generator`` is ``serving.Generator``
(imported lazily, so ``import moejax`` stays cheap). ``import moejax`` changes no
process-wide setting; :func:`configure_xla` sets the XLA flags the overlapping backends
want, before JAX starts (the ``moejax`` command calls it).
"""

from moejax.backends.xla_flags import configure_xla

__version__ = "0.1.0"

# Re-exported for users from the serving layer, which imports moejax: the only place
# moejax may name it, and only lazily (tests/test_layering.py).
_SERVING_NAMES = ("Scorer", "ScoreRequest", "ScoreResult", "Generator", "GenerationResult")


def __getattr__(name: str):
    if name in _SERVING_NAMES:
        import serving

        return getattr(serving, name)
    raise AttributeError(f"module 'moejax' has no attribute {name!r}")
