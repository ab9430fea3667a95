"""A wheel works outside the checkout (issue 41): every file moejax reads at run time (the
demo models' weights, training logs and shapes, the Scorer defaults, the deployments) is
package data, found through ``importlib.resources``.

The module builds the wheel from a copy of the sources (``pip wheel --no-deps
--no-build-isolation`` where this venv has setuptools >= 77, as a Python 3.11 venv does: no
download; and nothing is written into the checkout), installs it
into a fresh virtualenv outside the checkout (``pip install --no-deps --no-index``) and
makes the development venv's installed dependencies visible to it through a ``.pth`` line
(the development venv's own ``.pth`` files, among them the editable install's finder, are
not run from there, so the checkout is not importable). Then, from a temporary directory
and with ``$MOEJAX_CACHE`` and ``$HOME`` there, it runs ``moejax score`` with ``--model
demo`` and ``--model demo-e32``, ``moejax generate``, and ``Scorer("demo-e32-init")`` (its
seed is read from demo-e32's shipped ``train_log.json``), and checks that what ran came
from the new venv.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
# What the build reads: pyproject's packages and its readme.
BUILD_INPUTS = ("pyproject.toml", "README.md", "moejax", "kernels_pallas", "serving")
RUN_TIME_DATA = (
    "moejax/demo/configs/demo.yaml", "moejax/demo/configs/demo-e32.yaml",
    *(f"moejax/demo/{d}/{f}" for d in ("weights", "weights_e32")
      for f in ("config.json", "tokenizer.json", "model.safetensors", "train_log.json")),
    "serving/configs/scoring.yaml",
    *(f"serving/configs/deployments/{name}.yaml"
      for name in ("async_ep", "hybrid", "offload", "sync_ep", "tp")),
    "serving/grpc/scoring.proto",
)
PACKAGE_DIRS = tuple(str(REPO / name) + os.sep for name in ("moejax", "kernels_pallas", "serving"))
COMMAND_TIMEOUT = 240

REQUESTS = [
    {"id": "domain-code", "prompt": "Text: import os\nimport sys\nQuestion: Which domain is "
     "this? Answer:", "candidates": [" code", " prose", " math", " data"]},
    {"id": "claim", "prompt": "Claim: 7 + 6 = 13.\nTrue or false?",
     "candidates": [" true", " false"], "normalize": "vocab"},
    {"id": "quiz", "kind": "choice", "prompt": "What is 6 + 8?",
     "candidates": ["12", "15", "14", "16"]},
    {"id": "tags", "kind": "multi", "prompt": "Text: def area(w, h):\n    return w * h\n"
     "Which domains does it contain?", "candidates": ["code", "prose", "math", "data"]},
]


def _run(args, cwd, env, timeout=COMMAND_TIMEOUT) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, (f"{args} exited {proc.returncode}\nstdout:\n"
                                  f"{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}")
    return proc


def _copy_sources(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    dest.mkdir()
    for name in BUILD_INPUTS:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, dest / name, ignore=ignore)
        else:
            shutil.copy2(source, dest / name)


class Installed:
    """The wheel, the venv it is installed in, and how to run things there."""

    def __init__(self, root: Path):
        self.root = root
        self.wheel: Path
        self.venv = root / "venv"
        self.python = self.venv / "bin" / "python"
        self.site_packages: Path
        self.work = root / "work"          # the commands' current directory
        self.cache = root / "cache"        # $MOEJAX_CACHE
        self.env: dict[str, str]

    def run(self, args, **kwargs) -> subprocess.CompletedProcess:
        return _run(args, cwd=self.work, env=self.env, **kwargs)


def _build_isolation() -> list[str]:
    """``--no-build-isolation`` when this venv has the build backend pyproject asks for
    (a Python 3.11 venv has setuptools; no download then), else nothing: pip fetches it."""
    from importlib import metadata

    try:
        major = int(metadata.version("setuptools").split(".")[0])
    except (metadata.PackageNotFoundError, ValueError):
        return []
    return ["--no-build-isolation"] if major >= 77 else []


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    inst = Installed(tmp_path_factory.mktemp("wheel"))
    src, dist = inst.root / "src", inst.root / "dist"
    _copy_sources(src)
    base_env = {k: v for k, v in os.environ.items()
                if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")}
    isolation = _build_isolation()
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation,
          *(["--no-index"] if isolation else []), "-q", "-w", dist, src], cwd=inst.root,
         env=base_env)
    (inst.wheel,) = dist.glob("moejax-*.whl")

    _run([sys.executable, "-m", "venv", "--without-pip", inst.venv], cwd=inst.root,
         env=base_env)
    _run([sys.executable, "-m", "pip", "--python", inst.python, "install", "--no-deps",
          "--no-index", "-q", inst.wheel], cwd=inst.root, env=base_env)
    inst.site_packages = Path(_run(
        [inst.python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        cwd=inst.root, env=base_env).stdout.strip())
    # The dependencies (jax, numpy, ...) from the development venv, after the new venv's
    # own site-packages (written after the install, so pip saw only the new venv).
    dev_dirs = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (inst.site_packages / "zz_dev_dependencies.pth").write_text(
        "".join(f"{d}\n" for d in dev_dirs))

    inst.work.mkdir()
    (inst.root / "home").mkdir()
    inst.env = dict(base_env, MOEJAX_CACHE=str(inst.cache), HOME=str(inst.root / "home"),
                    XDG_CACHE_HOME=str(inst.root / "home" / ".cache"), PYTHONNOUSERSITE="1",
                    PATH=f"{inst.venv / 'bin'}{os.pathsep}{base_env.get('PATH', '')}")
    yield inst
    for name in ("src", "dist", "venv", "cache"):      # ~100 MB; pytest keeps 3 runs' dirs
        shutil.rmtree(inst.root / name, ignore_errors=True)


def _under(path: str | Path, directory: Path) -> bool:
    return Path(path).resolve().is_relative_to(directory.resolve())


def test_the_wheel_holds_the_run_time_files(installed):
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    missing = [name for name in RUN_TIME_DATA if name not in names]
    assert not missing, f"not in {installed.wheel.name}: {missing}"
    assert not any(name.startswith(("tests/", "benchmarks/", "configs/")) for name in names)


def test_the_packages_and_their_data_come_from_the_wheel(installed):
    script = """if True:
        import json, moejax, serving, kernels_pallas
        from moejax import demo
        from serving import options
        print(json.dumps({
            "modules": [moejax.__file__, serving.__file__, kernels_pallas.__file__],
            "data": [str(demo.WEIGHTS_DIR), str(demo.MODELS["demo-e32"].weights_dir),
                     str(demo.DEMO_CONFIG_PATH), str(options.DEFAULTS_PATH)],
            "defaults": options.read_yaml(options.DEFAULTS_PATH),
            "deployments": options.shipped_deployments(),
            "offload": options.load_options(deployment="offload").backend_options,
            "e32_experts": demo.demo_config("demo-e32").num_experts,
            "e32_seed": demo.init_seed("demo-e32"),
        }))
    """
    found = json.loads(installed.run([installed.python, "-c", script]).stdout)
    for path in found["modules"] + found["data"]:
        assert _under(path, installed.site_packages), path
        assert not _under(path, REPO), path
    assert found["defaults"]["max_candidates"] == 4096 and "backend" in found["defaults"]
    assert found["deployments"] == ["async_ep", "hybrid", "offload", "sync_ep", "tp"]
    assert found["offload"] == {"window": 2}
    assert found["e32_experts"] == 32 and isinstance(found["e32_seed"], int)


def _check_scores(results: list[dict], requests: list[dict]) -> None:
    assert [r["id"] for r in results] == [q["id"] for q in requests]
    for result, request in zip(results, requests):
        assert result["error"] is None, result
        assert isinstance(result["label"], int)
        assert 0 <= result["label"] < len(request["candidates"])
        assert len(result["logprobs"]) == len(request["candidates"])
        assert all(math.isfinite(x) and x <= 0 for x in result["logprobs"]), result
        if request.get("kind") == "multi":
            assert isinstance(result["selected"], list)
        elif request.get("normalize", "candidates") == "candidates":
            assert math.isclose(sum(math.exp(x) for x in result["logprobs"]), 1, abs_tol=1e-3)


@pytest.mark.parametrize("model, cache_name, weights", [("demo", "demo-v5", "weights"),
                                                       ("demo-e32", "demo-e32-v1", "weights_e32")])
def test_score_with_a_built_in_model(installed, model, cache_name, weights):
    requests = installed.work / "requests.jsonl"
    requests.write_text("".join(json.dumps(r) + "\n" for r in REQUESTS))
    out = installed.work / f"scores-{model}.jsonl"
    installed.run([installed.venv / "bin" / "moejax", "score", requests.name, "-o", out.name,
                   "--model", model])
    results = [json.loads(line) for line in out.read_text().splitlines()]
    _check_scores(results, REQUESTS)
    if model == "demo":
        assert results[0]["label"] == 0            # " code" (100 % held out, README)
    # The model came from the wheel into the temporary cache, the same files as shipped.
    copied = installed.cache / cache_name
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        assert (copied / name).read_bytes() == (REPO / "moejax/demo" / weights / name).read_bytes()


def test_generate_with_the_demo_model(installed):
    requests = installed.work / "generate.jsonl"
    requests.write_text(json.dumps({"id": "sum", "prompt": "12 + 9 =", "max_new_tokens": 2})
                        + "\n")
    out = installed.work / "generated.jsonl"
    installed.run([installed.venv / "bin" / "moejax", "generate", requests.name, "-o", out.name,
                   "--model", "demo"])
    (result,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert result["id"] == "sum" and result["error"] is None, result
    assert 1 <= len(result["token_ids"]) <= 2 and isinstance(result["text"], str)
    assert result["prompt_tokens"] > 0


def test_the_untrained_twin_is_generated_from_the_wheel(installed):
    script = f"""if True:
        import json, sys
        from serving import Scorer
        scorer = Scorer("demo-e32-init")
        (result,) = scorer.score([{{"id": "q", "prompt": "Claim: 2 + 2 = 4.\\nTrue or false?",
                                   "candidates": [" true", " false"]}}])
        from_checkout = sorted(m.__file__ for m in list(sys.modules.values())
                               if getattr(m, "__file__", None)
                               and m.__file__.startswith({PACKAGE_DIRS!r}))
        print(json.dumps({{"error": result.error, "logprobs": list(result.logprobs),
                          "label": result.label, "from_checkout": from_checkout}}))
    """
    found = json.loads(installed.run([installed.python, "-c", script]).stdout.splitlines()[-1])
    assert found["error"] is None and found["label"] in (0, 1)
    assert len(found["logprobs"]) == 2 and all(math.isfinite(x) for x in found["logprobs"])
    assert found["from_checkout"] == []       # no module of the checkout's packages
    twin = installed.cache / "demo-e32-init-v1"
    assert (twin / "model.safetensors").is_file()
    from moejax import checkpoint as ck
    from moejax import demo

    header = ck.read_safetensors_header(twin / "model.safetensors")
    assert header.metadata["init_seed"] == str(demo.init_seed("demo-e32"))
