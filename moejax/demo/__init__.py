"""A built-in demo model, so a new user can run the engine without downloading anything.

The demo is a tiny Qwen3-MoE (``configs/demo.yaml``) trained here by
:mod:`moejax.demo.train` on a four-domain corpus assembled from what ships with Python and
Debian (standard-library source as code, its docstrings and the Debian licence texts as
prose, generated arithmetic as math, generated JSON/CSV as data) plus labelled task text:
a domain question, arithmetic yes/no and true/false checks, multiple choice and
multi-selection (:mod:`moejax.demo.corpus`). Its tokenizer is a 1024-token byte-level BPE
trained on the same corpus.

The trained files ship in ``moejax/demo/weights/`` (Hugging Face layout: ``config.json``,
``tokenizer.json``, ``model.safetensors`` in bfloat16, plus ``train_log.json``).
:func:`ensure_demo_model` copies them into the moejax cache on first use and returns that
directory, so ``Scorer("demo")`` goes through the ordinary loading path.
``python -m moejax.demo.train --out DIR`` rebuilds them.

It is a toy: it answers its own task formats on its own domains and nothing else.

A second demo, ``demo-e32`` (``configs/demo-e32.yaml``: 6 layers, 32 experts at top-4),
is trained the same way on eight domains (:data:`moejax.demo.corpus.DOMAINS_E32`) so that
expert routing has structure to study; its untrained twin ``demo-e32-init`` is the same
seeded init exported the same way, generated on first use. :data:`MODELS` names them;
``Scorer(name)``, ``Generator(name)`` and ``--model name`` load any of them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from moejax.config import ModelConfig, from_hf_dict

DEMO_NOTICE = ("moejax demo model: a tiny toy MoE (about 2M parameters) trained here on a CPU "
               "on Python standard-library code, docstrings and licence texts, generated "
               "arithmetic and JSON/CSV. It names the domain of a text, completes small sums "
               "and products, checks claimed sums (yes/no, true/false) and picks a sum from "
               "lettered options, in the fixed formats it was trained on, and answers nothing "
               "else. Try the engine with it; do not evaluate anything with it.")

DEMO_NAME = "demo-v5"  # bump when the shipped files change, so old caches are not reused
DEMO_SEED = 0
CONFIGS_DIR = Path(__file__).resolve().parent.parent.parent / "configs"
DEMO_CONFIG_PATH = CONFIGS_DIR / "demo.yaml"
WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"

E32_NOTICE = ("moejax demo-e32: a small toy MoE (6 layers, 32 experts at top-4, about 5M "
              "parameters) trained here on a CPU on eight domains (Python, C headers, shell "
              "scripts, English prose, configuration files, Debian changelogs and man pages, "
              "generated arithmetic, generated JSON/CSV), to study expert routing. It "
              "answers its own task formats and nothing else; do not evaluate anything with "
              "it.")
E32_INIT_NOTICE = ("moejax demo-e32-init: the UNTRAINED twin of demo-e32 (its seeded init, "
                   "exported the same way). Its outputs are noise; it exists so that routing "
                   "figures can be compared with a model that learned nothing.")


@dataclass(frozen=True)
class DemoModel:
    """A built-in model: ``name`` as users type it, ``cache_name`` its versioned directory
    in the cache (bump when the files change), its shape file and shipped weights, the
    corpus domains it was trained on, and the notice shown when it is loaded. ``init_of``
    names the trained model whose seeded init this one is (generated, not shipped)."""

    name: str
    cache_name: str
    config_path: Path
    weights_dir: Path
    domains: tuple[str, ...]
    notice: str
    init_of: str | None = None


# The domain tuples equal corpus.DOMAINS and corpus.DOMAINS_E32 (a test checks); corpus is
# not imported here so that resolving a model name stays cheap.
MODELS: dict[str, DemoModel] = {
    "demo": DemoModel("demo", DEMO_NAME, DEMO_CONFIG_PATH, WEIGHTS_DIR,
                      ("code", "prose", "math", "data"), DEMO_NOTICE),
    "demo-e32": DemoModel("demo-e32", "demo-e32-v1", CONFIGS_DIR / "demo-e32.yaml",
                          Path(__file__).resolve().parent / "weights_e32",
                          ("python", "c", "shell", "prose", "config", "debian", "math", "data"),
                          E32_NOTICE),
}
MODELS["demo-e32-init"] = DemoModel("demo-e32-init", "demo-e32-init-v1",
                                    MODELS["demo-e32"].config_path, MODELS["demo-e32"].weights_dir,
                                    MODELS["demo-e32"].domains, E32_INIT_NOTICE,
                                    init_of="demo-e32")


def demo_model(name: str) -> DemoModel:
    """The :class:`DemoModel` called ``name``; a clear error naming the known ones."""
    if name not in MODELS:
        raise ValueError(f"unknown built-in model {name!r}; the built-in models are "
                         f"{sorted(MODELS)}")
    return MODELS[name]


SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
# Answers a scoring prompt typically uses; the tokenizer corpus makes each (with its
# leading space) one BPE token, so single-token candidate scoring applies to them. The
# domain names of the model's corpus are added to these.
ANSWER_WORDS = ("yes", "no", "Yes", "No", "true", "false", "True", "False",
                "A", "B", "C", "D", "code", "prose", "math", "data",
                "positive", "negative", "neutral")
_FILES = ("config.json", "tokenizer.json", "model.safetensors")
TOKENIZER_EXAMPLES = 20000


# =========================================================================== config
def demo_config_dict(name: str = "demo") -> dict[str, Any]:
    """The built-in model's shape file (``configs/demo.yaml``, ...) as a dict (HF keys)."""
    import yaml

    path = demo_model(name).config_path
    if not path.is_file():
        raise FileNotFoundError(f"demo model shape file {path} is missing")
    with open(path, encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def demo_config(name: str = "demo") -> ModelConfig:
    """The built-in model's :class:`ModelConfig` (from its ``configs/*.yaml``)."""
    return from_hf_dict(demo_config_dict(name))


# =========================================================================== tokenizer
def tokenizer_corpus(seed: int = DEMO_SEED, examples: int = TOKENIZER_EXAMPLES,
                     domains: tuple[str, ...] = MODELS["demo"].domains) -> Iterator[str]:
    """The tokenizer's training texts: the head of the training stream, then each answer
    word (and domain name) in an answer position, and each number below 50, often enough
    to become one token (so every sum and choice option of the arithmetic tasks is a
    single token)."""
    import itertools

    from moejax.demo import corpus

    mixture = None if domains == corpus.DOMAINS else corpus.for_domains(corpus.MIXTURE, domains)
    for ex in itertools.islice(corpus.stream(corpus.sources("train", domains), seed, mixture),
                               examples):
        yield ex.text
    for word in ANSWER_WORDS + tuple(d for d in domains if d not in ANSWER_WORDS):
        yield "\n".join(f"Answer: {word}" for _ in range(400))
    yield "\n".join(" ".join(str(n) for n in range(50)) for _ in range(400))


def build_demo_tokenizer(vocab_size: int = 1024, seed: int = DEMO_SEED,
                         examples: int = TOKENIZER_EXAMPLES,
                         domains: tuple[str, ...] = MODELS["demo"].domains):
    """A byte-level BPE ``tokenizers.Tokenizer`` with :data:`SPECIAL_TOKENS` at ids 0..3."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        # all 256 bytes, so any text encodes, whatever the corpus held
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(tokenizer_corpus(seed, examples, domains), trainer=trainer)
    return tokenizer


def check_tokenizer(tokenizer, hf_config: dict[str, Any]) -> None:
    """Raise if the tokenizer disagrees with the config's vocabulary size or special ids."""
    if tokenizer.get_vocab_size() != hf_config["vocab_size"]:
        raise RuntimeError(f"demo tokenizer has {tokenizer.get_vocab_size()} tokens but "
                           f"{DEMO_CONFIG_PATH} says vocab_size {hf_config['vocab_size']}")
    for key, token in (("bos_token_id", "<|endoftext|>"), ("eos_token_id", "<|endoftext|>"),
                       ("pad_token_id", "<|pad|>")):
        if hf_config.get(key) != tokenizer.token_to_id(token):
            raise RuntimeError(f"{DEMO_CONFIG_PATH}: {key} should be the id of {token}")


# =========================================================================== cache
def default_cache_root() -> str:
    """``$MOEJAX_CACHE``, else ``~/.cache/moejax``."""
    return os.environ.get("MOEJAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                          "moejax")


def _complete(path: str | os.PathLike) -> bool:
    return all(os.path.isfile(os.path.join(path, name)) for name in _FILES)


def twin_of(name: str) -> DemoModel | None:
    """The built-in untrained twin of built-in model ``name`` (demo-e32 -> demo-e32-init)."""
    return next((m for m in MODELS.values() if m.init_of == name), None)


def recorded_seed(model_dir: str | os.PathLike, default: int | None = None) -> int:
    """The init seed a model directory's ``train_log.json`` records (``train_config.seed``);
    ``default`` when there is none (raises when no default is given)."""
    import json

    log_path = os.path.join(model_dir, "train_log.json")
    seed = None
    if os.path.isfile(log_path):
        with open(log_path, encoding="utf-8") as fh:
            seed = json.load(fh).get("train_config", {}).get("seed")
    if seed is None and default is None:
        raise FileNotFoundError(f"{log_path} records no init seed (train_config.seed)")
    return int(default if seed is None else seed)


def init_seed(name: str) -> int:
    """The init seed recorded in built-in model ``name``'s ``train_log.json``."""
    return recorded_seed(demo_model(name).weights_dir)


def write_untrained_twin(model_dir: str | os.PathLike, out_dir: str, seed: int,
                         notice: str = "") -> None:
    """Write the untrained twin of the model in ``model_dir`` into ``out_dir``: its
    config, tokenizer (and generation config), and the training script's seeded init
    (:func:`moejax.demo.train.init_params`) in bfloat16, exported as trained weights are."""
    import ml_dtypes
    import numpy as np

    from moejax.config import load_config
    from moejax.demo import train
    from moejax.safetensors_io import write_safetensors

    for file in ("config.json", "tokenizer.json", "generation_config.json"):
        if os.path.isfile(os.path.join(model_dir, file)):
            shutil.copyfile(os.path.join(model_dir, file), os.path.join(out_dir, file))
    cfg = load_config(os.fspath(model_dir))
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
        shutil.copyfile(spec.weights_dir / file, os.path.join(out_dir, file))


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
