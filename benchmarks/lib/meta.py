"""The metadata of a run, and the one JSON a benchmark writes (``--json PATH``).

The JSON is the script's flat object of named figures (every printed ratio included),
plus flat ``meta_*`` keys (where and when it ran: :func:`run_metadata`) and the compile
figures of its timed passes (:func:`benchmarks.lib.compiles.run_figures`), so runs can
be compared and recorded. The figures keep their names; the added keys are only these.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
import subprocess
import sys
from typing import Any, Mapping

from benchmarks.lib import compiles
from benchmarks.lib.cli import REPO_ROOT


def git_commit() -> str | None:
    """The checkout's commit (with ``-dirty`` when it has changes), None outside git."""
    try:
        commit = subprocess.run(["git", "-C", str(REPO_ROOT), "describe", "--always",
                                 "--dirty", "--abbrev=40"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit or None


def run_metadata() -> dict[str, Any]:
    """Machine, date (UTC), Python, JAX and jaxlib versions, JAX's platform and device
    kind (only when the script has started JAX: a metadata call must not start it), and
    the git commit."""
    meta: dict[str, Any] = {
        "hostname": socket.gethostname(), "machine": platform.machine(),
        "cpu_count": os.cpu_count(), "system": platform.platform(),
        "python": platform.python_version(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit()}
    if "jax" in sys.modules:
        import jax
        import jaxlib

        meta.update(jax_version=jax.__version__, jaxlib_version=jaxlib.__version__,
                    jax_platform=jax.default_backend(),
                    device_kind=jax.devices()[0].device_kind, device_count=jax.device_count())
    return meta


def platform_figures() -> dict[str, str]:
    """``platform`` (JAX's default backend) and ``device_kind`` (of device 0), the two
    figures most benchmarks print beside their measurements (starts JAX)."""
    import jax

    return {"platform": jax.default_backend(), "device_kind": jax.devices()[0].device_kind}


def write_json(path: str | os.PathLike | None, figures: Mapping[str, Any]) -> None:
    """Write ``figures`` to ``path`` as JSON (nothing when ``path`` is None or empty),
    through a temporary file renamed over it, so that a reader, or a run killed mid-write
    (a device call's timeout), never finds half a file."""
    if not path:
        return
    path = os.fspath(path)
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(figures, fh, indent=2, default=str)
    os.replace(tmp, path)


def finish_run(figures: dict[str, Any], path: str | os.PathLike | None) -> dict[str, Any]:
    """The end of a benchmark: add the run's ``meta_*`` and compile keys to ``figures``
    (in place, so what its ``main`` returns is what the JSON holds), print how many
    compiles its timed passes saw (a warning when any did) and write the JSON to
    ``path``. Returns ``figures``."""
    counts = compiles.run_figures()
    if counts["timed_passes"]:
        compiled = {k[len("compiles_in_timed_pass_"):]: v for k, v in counts.items()
                    if k.startswith("compiles_in_timed_pass_")}
        line = (f"compiles in timed passes: {counts['compiles_in_timed_passes']} over "
                f"{counts['timed_passes']} counted pass(es)")
        print(f"WARNING: {line} (compiled: {compiled})" if compiled else line, flush=True)
    figures.update(counts)
    figures.update({f"meta_{key}": value for key, value in run_metadata().items()})
    write_json(path, figures)
    return figures
