"""What each built-in model is: its name, shape file, shipped weights, training domains
and notice (:data:`MODELS`), its config, and how its tokenizer is built and checked.

A module of its own (re-exported by :mod:`moejax.demo`) so that the training script
(:mod:`moejax.demo.train`) can read the specs without importing the package that, in
turn, runs the training script's init for an untrained twin.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
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
# Package data of moejax.demo (pyproject's [tool.setuptools.package-data]), found through
# importlib.resources so that a wheel or an editable install finds them alike: the shapes in
# configs/, the trained files in weights/ and weights_e32/. For a package on the file system
# (every pip install) these are pathlib.Path objects; the code reading them uses only the
# Traversable interface (``/``, ``is_file``, ``open``, ``read_text``).
_DATA: Traversable = resources.files("moejax.demo")
CONFIGS_DIR: Traversable = _DATA / "configs"
DEMO_CONFIG_PATH: Traversable = CONFIGS_DIR / "demo.yaml"
WEIGHTS_DIR: Traversable = _DATA / "weights"

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
    config_path: Traversable
    weights_dir: Traversable
    domains: tuple[str, ...]
    notice: str
    init_of: str | None = None


# The domain tuples equal corpus.DOMAINS and corpus.DOMAINS_E32 (a test checks); corpus is
# not imported here so that resolving a model name stays cheap.
MODELS: dict[str, DemoModel] = {
    "demo": DemoModel("demo", DEMO_NAME, DEMO_CONFIG_PATH, WEIGHTS_DIR,
                      ("code", "prose", "math", "data"), DEMO_NOTICE),
    "demo-e32": DemoModel("demo-e32", "demo-e32-v1", CONFIGS_DIR / "demo-e32.yaml",
                          _DATA / "weights_e32",
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
TOKENIZER_EXAMPLES = 20000


# =========================================================================== config
def demo_config_dict(name: str = "demo") -> dict[str, Any]:
    """The built-in model's shape file (``moejax/demo/configs/demo.yaml``, ...) as a dict
    (HF keys)."""
    import yaml

    path = demo_model(name).config_path
    if not path.is_file():
        raise FileNotFoundError(f"demo model shape file {path} is missing")
    with path.open("r", encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def demo_config(name: str = "demo") -> ModelConfig:
    """The built-in model's :class:`ModelConfig` (from its ``moejax/demo/configs/*.yaml``)."""
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
