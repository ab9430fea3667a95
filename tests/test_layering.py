"""Layering: ``moejax`` (model and execution) never imports ``serving`` (requests, CLI,
gRPC), ``import moejax`` changes no process-wide setting, and the entry points set what a
library leaves to its user (XLA flags, JAX's compilation cache)."""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("moejax", "kernels_pallas")
OVERLAP = "--xla_gpu_enable_latency_hiding_scheduler=true"


def _run(code: str, env: dict[str, str] | None = None) -> str:
    """stdout of ``python -c code`` at the repository root; fails with its stderr."""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300,
                          env=dict(env if env is not None else os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr
    return done.stdout


# ----------------------------------------------------------------------------- (a) environ
@pytest.mark.parametrize("module", ["moejax", "moejax.model", "moejax.backends"])
def test_import_leaves_os_environ_unchanged(module):
    code = ("import os, json; before = dict(os.environ); import " + module + "; "
            "print(json.dumps([before, dict(os.environ)]))")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # as a user's shell
    before, after = json.loads(_run(code, env))
    assert after == before


# ----------------------------------------------------------------------------- (b) imports
def _imports_of_serving(tree: ast.AST) -> list[tuple[int, str | None]]:
    """(line, enclosing function name or None) of every import of ``serving``."""
    found: list[tuple[int, str | None]] = []

    def visit(node: ast.AST, function: str | None) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        if any(name == "serving" or name.startswith("serving.") for name in names):
            found.append((node.lineno, function))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, None)
    return found


def test_scanner_finds_nested_imports():
    source = ("def f():\n    if x:\n        from serving.api import Scorer\n"
              "import serving.cli\nimport servingx\nfrom . import serving\n")
    assert _imports_of_serving(ast.parse(source)) == [(3, "f"), (4, None)]


def test_moejax_and_kernels_never_import_serving():
    files = [p for layer in LAYERS for p in sorted((ROOT / layer).rglob("*.py"))]
    assert len(files) > 20, files
    offending = []
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, function in _imports_of_serving(tree):
            # The one exception: moejax/__init__.py re-exports Scorer & co. lazily.
            if path == ROOT / "moejax" / "__init__.py" and function == "__getattr__":
                continue
            offending.append(f"{path.relative_to(ROOT)}:{line}")
    assert not offending, f"imports of the serving layer: {offending}"


def test_lazy_reexports_still_work():
    import moejax
    import serving

    assert moejax.Scorer is serving.Scorer and moejax.Generator is serving.Generator
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        moejax.nope


def test_the_command_line_starts_without_jax():
    """``import serving.cli`` (every ``moejax`` command's start) loads neither JAX nor the
    model code: a command that only talks to a server never needs them, and the others
    load them when they build a Scorer (before: 3 s of imports per start)."""
    code = ("import sys, serving.cli, serving; "
            "heavy = sorted(m for m in ('jax', 'scipy.stats', 'moejax.model', 'serving.api') "
            "if m in sys.modules); print(heavy)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def test_serving_names_load_on_first_use():
    import serving
    from serving.api import Scorer
    from serving.generate import Generator

    assert serving.Scorer is Scorer and serving.Generator is Generator
    assert set(serving.__all__) <= set(dir(serving))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        serving.nope


# ----------------------------------------------------------------------------- (c) script
def test_console_script_resolves_to_a_callable():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, attr = scripts["moejax"].partition(":")
    assert module.split(".")[0] == "serving", scripts["moejax"]
    target = getattr(importlib.import_module(module), attr)
    assert callable(target)
    with pytest.raises(SystemExit) as info:   # it is the command: --help exits 0
        target(["--help"])
    assert info.value.code == 0


def test_old_cli_module_is_gone():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("moejax.cli")


# ----------------------------------------------------------------------------- (d) XLA
def test_configure_xla_adds_the_flags_in_a_fresh_process():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = "--xla_dump_to=/nonexistent"   # the user's flags are kept, first
    code = ("import os, json, warnings; warnings.simplefilter('error'); import moejax; "
            "before = os.environ['XLA_FLAGS']; added = moejax.configure_xla(host_devices=3); "
            "again = moejax.configure_xla(); "
            "print(json.dumps([before, added, again, os.environ['XLA_FLAGS']]))")
    before, added, again, after = json.loads(_run(code, env))
    assert before == "--xla_dump_to=/nonexistent"
    assert added == [OVERLAP, "--xla_force_host_platform_device_count=3"] and again == []
    assert after.split() == ["--xla_dump_to=/nonexistent", *added]


def test_cli_configures_xla_for_its_devices_before_running(monkeypatch):
    from serving import cli

    class Stop(Exception):
        pass

    calls = []

    def record(**kwargs):
        calls.append(kwargs)
        raise Stop

    monkeypatch.setattr(cli, "configure_xla", record)
    with pytest.raises(Stop):    # raised before the command could start JAX
        cli.main(["score", "-", "--engines", "3", "--devices", "2"])
    with pytest.raises(Stop):
        cli.main(["serve", "--devices", "4"])
    assert calls == [{"host_devices": 3}, {"host_devices": 4}]


# ----------------------------------------------------------------------------- compilation cache
def test_commands_turn_the_compilation_cache_on(tmp_path):
    from serving import cli
    from serving.cli.options import command_compilation_cache, scorer_options

    assert command_compilation_cache(None) == "auto"
    args = cli.build_parser().parse_args(["score", "-"])
    assert scorer_options(args)["compilation_cache"] == "auto"
    deployment = tmp_path / "d.yaml"
    deployment.write_text("compilation_cache: 'off'\n")   # a deployment's choice wins
    args = cli.build_parser().parse_args(["score", "-", "--deployment", str(deployment)])
    assert scorer_options(args)["compilation_cache"] == "off"


def test_scorer_leaves_the_compilation_cache_alone_unless_asked(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(MOEJAX_CACHE=str(tmp_path), JAX_PLATFORMS="cpu")
    code = ("import jax; from serving import Scorer; "
            "Scorer('demo', max_batch_tokens=64, calibrate=False); "
            "print(repr(jax.config.jax_compilation_cache_dir)); "
            "Scorer('demo', max_batch_tokens=64, calibrate=False, compilation_cache='auto'); "
            "print(jax.config.jax_compilation_cache_dir)")
    default, asked = _run(code, env).splitlines()[-2:]
    assert default in ("None", "''")
    assert asked == str(tmp_path / "jax-cache")
