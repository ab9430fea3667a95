"""A built-in demo model, so a new user can run the engine without downloading anything.

The demo is a tiny Qwen3-MoE (``moejax/demo/configs/demo.yaml``) trained here by
:mod:`moejax.demo.train` on a four-domain corpus assembled from what ships with Python and
Debian (standard-library source as code, its docstrings and the Debian licence texts as
prose, generated arithmetic as math, generated JSON/CSV as data) plus labelled task text:
a domain question, arithmetic yes/no and true/false checks, multiple choice and
multi-selection (:mod:`moejax.demo.corpus`). Its tokenizer is a 1024-token byte-level BPE
trained on the same corpus.

The trained files ship in ``moejax/demo/weights/`` (Hugging Face layout: ``config.json``,
``tokenizer.json``, ``model.safetensors`` in bfloat16, plus ``train_log.json``), package
data read through :mod:`importlib.resources` (so a wheel carries them; see
:mod:`moejax.demo.specs`). :func:`ensure_demo_model` copies them into the moejax cache on
first use and returns that directory, so ``Scorer("demo")`` goes through the ordinary
loading path.
``python -m moejax.demo.train --out DIR`` rebuilds them.

It is a toy: it answers its own task formats on its own domains and nothing else.

A second demo, ``demo-e32`` (``moejax/demo/configs/demo-e32.yaml``: 6 layers, 32 experts at top-4),
is trained the same way on eight domains (:data:`moejax.demo.corpus.DOMAINS_E32`) so that
expert routing has structure to study; its untrained twin ``demo-e32-init`` is the same
seeded init exported the same way, generated on first use from demo-e32's shipped files
(its seed from their ``train_log.json``). :data:`MODELS` names them;
``Scorer(name)``, ``Generator(name)`` and ``--model name`` load any of them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from importlib.resources.abc import Traversable
from pathlib import Path

from moejax.demo.specs import (
    DEMO_NOTICE, DEMO_NAME, DEMO_SEED, CONFIGS_DIR, DEMO_CONFIG_PATH, WEIGHTS_DIR, E32_NOTICE,
    E32_INIT_NOTICE, DemoModel, MODELS, demo_model, SPECIAL_TOKENS, ANSWER_WORDS,
    TOKENIZER_EXAMPLES, demo_config_dict, demo_config, tokenizer_corpus, build_demo_tokenizer,
    check_tokenizer)

__all__ = ["DEMO_NOTICE", "DEMO_NAME", "DEMO_SEED", "CONFIGS_DIR", "DEMO_CONFIG_PATH",
           "WEIGHTS_DIR", "E32_NOTICE", "E32_INIT_NOTICE", "DemoModel", "MODELS",
           "demo_model", "SPECIAL_TOKENS", "ANSWER_WORDS", "TOKENIZER_EXAMPLES",
           "demo_config_dict", "demo_config", "tokenizer_corpus", "build_demo_tokenizer",
           "check_tokenizer", "default_cache_root", "twin_of", "recorded_seed",
           "init_seed", "write_untrained_twin", "write_init_model", "write_demo_model",
           "ensure_demo_model"]

_FILES = ("config.json", "tokenizer.json", "model.safetensors")


# =========================================================================== cache
def default_cache_root() -> str:
    """``$MOEJAX_CACHE``, else ``~/.cache/moejax``."""
    return os.environ.get("MOEJAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                          "moejax")


def _as_dir(path: str | os.PathLike | Traversable) -> Traversable:
    """A model directory as a Traversable: a path on disk as a :class:`pathlib.Path`, a
    package-data directory (:data:`WEIGHTS_DIR`, ``weights_dir``) as it is."""
    return Path(path) if isinstance(path, (str, os.PathLike)) else path


def _complete(path: str | os.PathLike | Traversable) -> bool:
    directory = _as_dir(path)
    return all((directory / name).is_file() for name in _FILES)


def _copy(source: Traversable, dest: str) -> None:
    """Copy one file (on disk or package data) to the path ``dest``."""
    if isinstance(source, os.PathLike):
        shutil.copyfile(source, dest)
        return
    with source.open("rb") as fin, open(dest, "wb") as fout:
        shutil.copyfileobj(fin, fout)


def twin_of(name: str) -> DemoModel | None:
    """The built-in untrained twin of built-in model ``name`` (demo-e32 -> demo-e32-init)."""
    return next((m for m in MODELS.values() if m.init_of == name), None)


def recorded_seed(model_dir: str | os.PathLike | Traversable, default: int | None = None) -> int:
    """The init seed a model directory's ``train_log.json`` records (``train_config.seed``);
    ``default`` when there is none (raises when no default is given)."""
    import json

    log_path = _as_dir(model_dir) / "train_log.json"
    seed = None
    if log_path.is_file():
        seed = json.loads(log_path.read_text(encoding="utf-8")).get("train_config", {}).get("seed")
    if seed is None and default is None:
        raise FileNotFoundError(f"{log_path} records no init seed (train_config.seed)")
    return int(default if seed is None else seed)


def init_seed(name: str) -> int:
    """The init seed recorded in built-in model ``name``'s ``train_log.json``."""
    return recorded_seed(demo_model(name).weights_dir)


def write_untrained_twin(model_dir: str | os.PathLike | Traversable, out_dir: str, seed: int,
                         notice: str = "") -> None:
    """Write the untrained twin of the model in ``model_dir`` (a directory, or package
    data) into ``out_dir``: its config, tokenizer (and generation config), and the training
    script's seeded init (:func:`moejax.demo.train.init_params`) in bfloat16, exported as
    trained weights are."""
    import ml_dtypes
    import numpy as np

    from moejax.config import load_config
    from moejax.demo import train
    from moejax.safetensors_io import write_safetensors

    source = _as_dir(model_dir)
    if not (source / "config.json").is_file():
        raise FileNotFoundError(f"{source}: no config.json")
    for file in ("config.json", "tokenizer.json", "generation_config.json"):
        if (source / file).is_file():
            _copy(source / file, os.path.join(out_dir, file))
    cfg = load_config(out_dir)       # the copy just made: the source may not be on disk
    params = train.init_params(cfg, seed)
    write_safetensors(os.path.join(out_dir, "model.safetensors"),
                      train.params_to_hf(params, cfg, np.dtype(ml_dtypes.bfloat16)),
                      metadata={"format": "pt", "init_seed": str(seed),
                                "notice": notice or f"untrained init, seed {seed}"})


def write_init_model(name: str, out_dir: str) -> None:
    """Write the untrained twin of built-in model ``name`` (the seed its
    ``train_log.json`` records) into ``out_dir``."""
    twin = twin_of(name)
    write_untrained_twin(demo_model(name).weights_dir, out_dir, init_seed(name),
                         twin.notice if twin else "")


def write_demo_model(out_dir: str, name: str = "demo") -> None:
    """Write built-in model ``name`` into the existing directory ``out_dir``: the three
    shipped files, or for an untrained twin its generated init."""
    spec = demo_model(name)
    if spec.init_of is not None:
        write_init_model(spec.init_of, out_dir)
        return
    if not _complete(spec.weights_dir):
        raise FileNotFoundError(
            f"the trained {name} weights are missing from {spec.weights_dir}; rebuild them "
            f"with `python -m moejax.demo.train --model {name} --out {spec.weights_dir}`")
    for file in _FILES:
        _copy(spec.weights_dir / file, os.path.join(out_dir, file))


def ensure_demo_model(cache_dir: str | os.PathLike | None = None, name: str = "demo") -> str:
    """Path of built-in model ``name``'s directory ``<cache>/<cache_name>`` (``demo-v5``
    for the demo), creating it on first use.

    ``cache_dir`` is the cache root (default :func:`default_cache_root`). The files are
    written into a temporary sibling and renamed into place, so concurrent first uses are
    safe: one rename wins and the others discard their copy.
    """
    spec = demo_model(name)
    root = os.path.abspath(os.fspath(cache_dir) if cache_dir is not None else default_cache_root())
    final = os.path.join(root, spec.cache_name)
    # Existence first: the directory only ever appears by an atomic rename of a complete
    # copy, so once it exists its contents are final (checking completeness first would
    # race with a concurrent first use renaming in between the two checks).
    if os.path.exists(final):
        if _complete(final):
            return final
        raise RuntimeError(f"{final} exists but is not a complete {name} model; delete it and "
                           "try again")
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{spec.cache_name}.tmp-", dir=root)
    try:
        write_demo_model(tmp, name)
        os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; the cache may be shared
        try:
            os.rename(tmp, final)
        except OSError:
            if not _complete(final):  # not a lost race: something else sits at ``final``
                raise RuntimeError(f"{final} exists but is not a complete {name} model; "
                                   "delete it and try again") from None
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final
