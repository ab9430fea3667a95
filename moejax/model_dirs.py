"""A model's name to its directory: a built-in model (:data:`moejax.demo.MODELS`, made in
the cache on first use), a local directory, or a Hugging Face hub id (``ORG/NAME`` or
``ORG/NAME@REVISION``, :mod:`moejax.hub`: its snapshot in the Hugging Face cache). What
``Scorer(model)``, ``Generator(model)`` and every command's ``--model`` accept.

A module of its own, above both :mod:`moejax.checkpoint` (which reads a directory) and
:mod:`moejax.demo` (which makes the built-in ones, with the checkpoint reader), so neither
imports the other in a circle.
"""

from __future__ import annotations

import os

from moejax import demo, hub


def resolve_model_dir(model: str | os.PathLike) -> tuple[str, bool]:
    """A built-in model's name (``"demo"``, ``"demo-e32"``, ``"demo-e32-init"``: created
    in the cache on first use) -> its directory; else a local directory; else a hub id
    (a string ``ORG/NAME[@REVISION]``) -> its snapshot, downloaded unless cached.

    Returns (path, is_demo). A built-in name wins over a local directory of that name
    (write ``./demo`` for the directory), and a local directory over a hub id spelt the
    same. A hub id that cannot be had raises :class:`moejax.hub.HubModelError`, anything
    else that is no model FileNotFoundError."""
    path = os.fspath(model)
    if path in demo.MODELS:
        return demo.ensure_demo_model(name=path), True
    if os.path.isdir(path):
        return path, False
    model_id = hub.parse_model_id(model) if isinstance(model, str) else None
    if model_id is not None:
        return hub.snapshot_dir(model_id), False
    raise FileNotFoundError(f"model directory {path!r} does not exist (give a local Hugging "
                            f"Face model directory, a converted moejax directory, a Hugging "
                            f"Face hub id ORG/NAME[@REVISION], or a built-in model: "
                            f"{', '.join(sorted(demo.MODELS))})")


def model_display_name(model: str | os.PathLike, model_dir: str, is_demo: bool) -> str:
    """The name a model is served under, safe to show a remote caller (never a path): a
    built-in model's name, a hub model's repository id (``Qwen/Qwen3-30B-A3B``, not its
    snapshot's commit directory), else the name of its directory. ``model``, ``model_dir``
    and ``is_demo`` as given to and returned by :func:`resolve_model_dir`."""
    if is_demo:
        return os.fspath(model)
    if isinstance(model, str) and not os.path.isdir(model):
        model_id = hub.parse_model_id(model)
        if model_id is not None:
            return model_id.repo_id
    return os.path.basename(os.path.normpath(model_dir))
