"""moejax: prefill-only Mixture-of-Experts serving in JAX.

``moejax.Scorer`` is ``serving.Scorer`` (imported lazily, so ``import moejax`` stays cheap).
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name in ("Scorer", "ScoreRequest", "ScoreResult"):
        import serving

        return getattr(serving, name)
    raise AttributeError(f"module 'moejax' has no attribute {name!r}")
