"""A model's name to its directory: a built-in model (:data:`moejax.demo.MODELS`, made in
the cache on first use) or a local directory. What ``Scorer(model)``, ``Generator(model)``
and every command's ``--model`` accept.

A module of its own, above both :mod:`moejax.checkpoint` (which reads a directory) and
:mod:`moejax.demo` (which makes the built-in ones, with the checkpoint reader), so neither
imports the other in a circle.
"""

from __future__ import annotations

import os

from moejax import demo


def resolve_model_dir(model: str | os.PathLike) -> tuple[str, bool]:
    """A built-in model's name (``"demo"``, ``"demo-e32"``, ``"demo-e32-init"``: created
    in the cache on first use) -> its directory; else a local directory.

    Returns (path, is_demo). A built-in name wins over a local directory of that name
    (write ``./demo`` for the directory)."""
    path = os.fspath(model)
    if path in demo.MODELS:
        return demo.ensure_demo_model(name=path), True
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path!r} does not exist (give a local Hugging "
                                f"Face model directory, a converted moejax directory, or a "
                                f"built-in model: {', '.join(sorted(demo.MODELS))})")
    return path, False
