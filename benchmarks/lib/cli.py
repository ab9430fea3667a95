"""The command line every benchmark shares, and the XLA flags set from it before JAX starts.

A script builds its parser with :func:`bench_parser` (``--quick``, ``--json PATH`` and,
where it uses them, ``--model``, ``--repeats``, ``--devices``), adds its own flags, and
calls :func:`parse_args`, which parses, sets the CPU host-device count (and, when asked,
moejax's GPU overlap flags) in ``XLA_FLAGS`` and starts a fresh compile tally. XLA reads
its flags once, when JAX starts, so the script imports JAX only after that call.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

# The repository root (the benchmarks' default output and trace folders are below it).
REPO_ROOT = Path(__file__).resolve().parents[2]
HOST_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def bench_parser(doc: str | None, *, quick_help: str, model: str | None = None,
                 model_help: str | None = None, repeats: int | None = None,
                 repeats_help: str | None = None, devices_help: str | None = None,
                 traces: bool = False) -> argparse.ArgumentParser:
    """A parser with ``--quick`` and ``--json PATH`` (``args.json_path``); ``--model``
    when ``model`` (its default) is given, ``--repeats`` when ``repeats_help`` is
    (default ``repeats``), ``--devices`` when ``devices_help`` is, ``--traces DIR`` (the
    reference expert traces, ``out/traces``) with ``traces``. The description is the
    first paragraph of the script's docstring ``doc``."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--json", dest="json_path", metavar="PATH",
                        help="write the figures (and the run's metadata) to this JSON file")
    if model is not None:
        parser.add_argument("--model", default=model,
                            help=model_help or f"model directory or built-in name "
                                               f"(default {model})")
    if repeats_help is not None:
        parser.add_argument("--repeats", type=int, default=repeats, help=repeats_help)
    if devices_help is not None:
        parser.add_argument("--devices", type=int, help=devices_help)
    if traces:
        parser.add_argument("--traces", default=str(REPO_ROOT / "out" / "traces"),
                            help="folder of the reference traces (written when missing; "
                                 "--quick uses a temporary one)")
    return parser


def run_shape(args: argparse.Namespace, quick: Mapping[str, Any], full: Mapping[str, Any],
              overrides: Iterable[str] = ()) -> dict[str, Any]:
    """A script's sizes: ``quick`` with ``--quick``, else ``full``, with each of the
    ``overrides`` (argument names) replaced by its argument where one was given."""
    shape = dict(quick if args.quick else full)
    for key in overrides:
        if getattr(args, key, None) is not None:
            shape[key] = getattr(args, key)
    return shape


def jax_started() -> bool:
    """Whether JAX has started its backends (XLA read ``XLA_FLAGS`` then; importing jax
    does not start them). JAX has no public way to ask, so this reads its backend
    registry, and counts an unreadable one as started."""
    if "jax" not in sys.modules:
        return False
    bridge = sys.modules.get("jax._src.xla_bridge")
    backends = getattr(bridge, "_backends", None)
    return backends is None or bool(backends)


def force_host_devices(count: int) -> None:
    """Ask XLA for ``count`` CPU host devices unless ``XLA_FLAGS`` already names a count
    (the user's, or a test session's). A GPU run ignores the flag."""
    if HOST_DEVICE_FLAG in os.environ.get("XLA_FLAGS", ""):
        return
    if jax_started():
        raise RuntimeError(f"force_host_devices({count}) must run before JAX starts its "
                           f"backends (XLA has read its flags)")
    from moejax.backends.xla_flags import apply_host_device_count

    apply_host_device_count(count)


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None, *,
               host_devices: int | None = None, gpu_overlap_flags: bool = False
               ) -> argparse.Namespace:
    """Parse ``argv``; then, before JAX starts, ask for ``host_devices`` CPU devices and
    (``gpu_overlap_flags``) moejax's GPU flags (``moejax.configure_xla``); then start
    this run's tally of compiles in timed passes."""
    from benchmarks.lib import compiles

    args = parser.parse_args(None if argv is None else list(argv))
    if host_devices:
        force_host_devices(host_devices)
    if gpu_overlap_flags and not jax_started():
        # (Called in-process after JAX started, e.g. from a test, the flags could no
        # longer take effect here and would only leak into child processes.)
        from moejax.backends.xla_flags import apply_overlap_flags

        apply_overlap_flags()
    compiles.start_run()
    return args
