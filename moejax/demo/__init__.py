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
"""

from __future__ import annotations

import os
import shutil
import tempfile
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
DEMO_CONFIG_PATH = Path(__file__).resolve().parent.parent.parent / "configs" / "demo.yaml"
WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
# Answers a scoring prompt typically uses; the tokenizer corpus makes each (with its
# leading space) one BPE token, so single-token candidate scoring applies to them.
ANSWER_WORDS = ("yes", "no", "Yes", "No", "true", "false", "True", "False",
                "A", "B", "C", "D", "code", "prose", "math", "data",
                "positive", "negative", "neutral")
_FILES = ("config.json", "tokenizer.json", "model.safetensors")
TOKENIZER_EXAMPLES = 20000


# =========================================================================== config
def demo_config_dict() -> dict[str, Any]:
    """``configs/demo.yaml`` as a dict (HF config.json keys)."""
    import yaml

    if not DEMO_CONFIG_PATH.is_file():
        raise FileNotFoundError(f"demo model shape file {DEMO_CONFIG_PATH} is missing")
    with open(DEMO_CONFIG_PATH, encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def demo_config() -> ModelConfig:
    """The demo model's :class:`ModelConfig` (from ``configs/demo.yaml``)."""
    return from_hf_dict(demo_config_dict())


# =========================================================================== tokenizer
def tokenizer_corpus(seed: int = DEMO_SEED, examples: int = TOKENIZER_EXAMPLES) -> Iterator[str]:
    """The tokenizer's training texts: the head of the training stream, then each answer
    word in an answer position, and each number below 50, often enough to become one
    token (so every sum and choice option of the arithmetic tasks is a single token)."""
    import itertools

    from moejax.demo import corpus

    for ex in itertools.islice(corpus.stream(corpus.sources("train"), seed), examples):
        yield ex.text
    for word in ANSWER_WORDS:
        yield "\n".join(f"Answer: {word}" for _ in range(400))
    yield "\n".join(" ".join(str(n) for n in range(50)) for _ in range(400))


def build_demo_tokenizer(vocab_size: int = 1024, seed: int = DEMO_SEED,
                         examples: int = TOKENIZER_EXAMPLES):
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
    tokenizer.train_from_iterator(tokenizer_corpus(seed, examples), trainer=trainer)
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


def write_demo_model(out_dir: str) -> None:
    """Copy the three shipped demo files into the existing directory ``out_dir``."""
    if not _complete(WEIGHTS_DIR):
        raise FileNotFoundError(
            f"the trained demo weights are missing from {WEIGHTS_DIR}; rebuild them with "
            f"`python -m moejax.demo.train --out {WEIGHTS_DIR}`")
    for name in _FILES:
        shutil.copyfile(WEIGHTS_DIR / name, os.path.join(out_dir, name))


def ensure_demo_model(cache_dir: str | os.PathLike | None = None) -> str:
    """Path of the demo model directory ``<cache>/demo-v5``, creating it on first use.

    ``cache_dir`` is the cache root (default :func:`default_cache_root`). The files are
    copied into a temporary sibling and renamed into place, so concurrent first uses are
    safe: one rename wins and the others discard their copy.
    """
    root = os.path.abspath(os.fspath(cache_dir) if cache_dir is not None else default_cache_root())
    final = os.path.join(root, DEMO_NAME)
    # Existence first: the directory only ever appears by an atomic rename of a complete
    # copy, so once it exists its contents are final (checking completeness first would
    # race with a concurrent first use renaming in between the two checks).
    if os.path.exists(final):
        if _complete(final):
            return final
        raise RuntimeError(f"{final} exists but is not a complete demo model; delete it and "
                           "try again")
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{DEMO_NAME}.tmp-", dir=root)
    try:
        write_demo_model(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; the cache may be shared
        try:
            os.rename(tmp, final)
        except OSError:
            if not _complete(final):  # not a lost race: something else sits at ``final``
                raise RuntimeError(f"{final} exists but is not a complete demo model; "
                                   "delete it and try again") from None
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final
