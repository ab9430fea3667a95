"""JAX's persistent compilation cache, turned on only when asked.

The cache directory is a process-wide JAX setting, so a library object (``Scorer``,
``Generator``) leaves it alone unless given ``compilation_cache=``; the ``moejax``
commands turn it on (``"auto"``) so that a restarted job reuses its compiled shapes.

    from serving import enable_compilation_cache
    enable_compilation_cache()              # $MOEJAX_CACHE/jax-cache (~/.cache/moejax/jax-cache)
    enable_compilation_cache("/scratch/jax-cache")
"""

from __future__ import annotations

import os

OFF = ("off", "")


def resolve_compilation_cache(setting: str | bool | None) -> str | None:
    """The directory a ``compilation_cache`` setting names: ``"auto"`` ->
    ``$MOEJAX_CACHE/jax-cache`` (default ``~/.cache/moejax/jax-cache``), a path -> that path
    (``~`` expanded), None / ``"off"`` / ``""`` / False -> None (no cache). False is what
    YAML reads from an unquoted ``off``."""
    if setting is None or setting is False or setting in OFF:
        return None
    if not isinstance(setting, str):
        raise ValueError(f"compilation_cache must be a directory, 'auto', 'off' or None, "
                         f"got {setting!r}")
    if setting == "auto":
        from moejax.demo import default_cache_root

        return os.path.join(default_cache_root(), "jax-cache")
    return os.path.expanduser(setting)


def enable_compilation_cache(setting: str | bool | None = "auto") -> str | None:
    """Point JAX's persistent compilation cache at the directory ``setting`` names (see
    :func:`resolve_compilation_cache`; None or ``"off"`` change nothing). A cache directory
    already configured in JAX is kept. Returns the directory JAX uses afterwards, or None."""
    import jax

    directory = resolve_compilation_cache(setting)
    if directory is not None and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", directory)
    return jax.config.jax_compilation_cache_dir or None
