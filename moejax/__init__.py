"""moejax: prefill-only Mixture-of-Experts serving in JAX.

``moejax.Scorer`` is ``serving.Scorer`` and ``moejax.Generator`` is ``serving.Generator``
(imported lazily, so ``import moejax`` stays cheap).
"""

__version__ = "0.1.0"


def _set_xla_flags() -> None:
    # Before JAX starts its backends: the overlapping backends need the GPU scheduler
    # flags (moejax/backends/xla_flags.py); too late once JAX has started, which that
    # module's warning then reports.
    from moejax.backends import xla_flags

    if not xla_flags.backends_started():
        xla_flags.apply_overlap_flags()


_set_xla_flags()


def __getattr__(name: str):
    if name in ("Scorer", "ScoreRequest", "ScoreResult", "Generator", "GenerationResult"):
        import serving

        return getattr(serving, name)
    raise AttributeError(f"module 'moejax' has no attribute {name!r}")
