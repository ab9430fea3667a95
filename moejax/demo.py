"""A built-in demo model, so a new user can run the engine without downloading anything.

:func:`ensure_demo_model` creates, on first use, a Hugging Face-format model directory
(``config.json``, ``tokenizer.json``, ``model.safetensors``) under the moejax cache and
returns its path; later calls reuse it. Its shape is ``configs/demo.yaml`` (a small
``qwen3_moe``: 4 layers, d=256, 16 experts, top-4), its tokenizer a 1024-token byte-level
BPE trained here on a corpus generated in code, and its weights are seeded random numbers.

The weights are NOT trained: every score, log-probability and generated token of the demo
model is meaningless. It exists to exercise loading, batching, routing and scoring.

Everything is deterministic: the same code writes byte-identical files.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from moejax.checkpoint import hf_tensor_plan
from moejax.safetensors_io import write_safetensors
from moejax.config import ModelConfig, from_hf_dict

DEMO_NOTICE = ("moejax demo model: its weights are random and untrained, so its scores, "
               "probabilities and outputs are meaningless. Use it to try the engine, not to "
               "evaluate anything.")

DEMO_NAME = "demo-v1"  # bump when the files would change, so old caches are not reused
DEMO_SEED = 0
DEMO_CONFIG_PATH = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"
WEIGHT_SCALE = 0.02
SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>")
# Words an evaluation prompt typically scores as answers; the corpus makes each (with its
# leading space) frequent enough to become one BPE token.
ANSWER_WORDS = ("yes", "no", "Yes", "No", "true", "false", "True", "False",
                "A", "B", "C", "D", "positive", "negative", "neutral")
_FILES = ("config.json", "tokenizer.json", "model.safetensors")


# =========================================================================== config
def demo_config_dict() -> dict[str, Any]:
    """``configs/demo.yaml`` as a dict (HF config.json keys)."""
    import yaml

    if not DEMO_CONFIG_PATH.is_file():
        raise FileNotFoundError(f"demo model shape file {DEMO_CONFIG_PATH} is missing")
    with open(DEMO_CONFIG_PATH, encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def demo_config() -> ModelConfig:
    return from_hf_dict(demo_config_dict())


# =========================================================================== tokenizer
_NOUNS = ("cat", "dog", "bird", "fish", "horse", "house", "car", "tree", "book", "river",
          "city", "music", "movie", "food", "water", "sun", "moon", "star", "road", "door",
          "table", "chair", "school", "teacher", "student", "friend", "mother", "father",
          "child", "game", "song", "story", "phone", "computer", "garden", "flower", "apple",
          "bread", "coffee", "train", "ship", "mountain", "island", "country", "language",
          "number", "question", "answer", "problem", "world", "team", "price", "service")
_ADJECTIVES = ("good", "bad", "great", "terrible", "happy", "sad", "big", "small", "old",
               "new", "hot", "cold", "fast", "slow", "red", "blue", "green", "bright", "dark",
               "long", "short", "easy", "hard", "cheap", "expensive", "beautiful", "boring",
               "wonderful", "awful", "excellent", "poor", "friendly", "quiet", "loud")
_VERBS = ("likes", "sees", "finds", "makes", "takes", "knows", "wants", "reads", "writes",
          "opens", "closes", "buys", "sells", "plays", "helps", "loves", "hates", "visits")
# Everyday words for filler sentences, so the BPE vocabulary fills up with real words.
_COMMON = ("the", "of", "and", "to", "in", "is", "that", "it", "was", "for", "on", "are", "as",
           "with", "his", "they", "at", "be", "this", "have", "from", "or", "one", "had", "by",
           "word", "but", "not", "what", "all", "were", "we", "when", "your", "can", "said",
           "there", "use", "an", "each", "which", "she", "do", "how", "their", "if", "will",
           "up", "other", "about", "out", "many", "then", "them", "these", "so", "some", "her",
           "would", "make", "like", "him", "into", "time", "has", "look", "two", "more",
           "write", "go", "see", "way", "could", "people", "my", "than", "first", "been",
           "call", "who", "its", "now", "find", "day", "did", "get", "come", "made", "may",
           "part", "over", "say", "great", "where", "help", "through", "much", "before",
           "line", "right", "too", "means", "same", "tell", "boy", "follow", "came", "show",
           "also", "around", "form", "three", "small", "set", "put", "end", "does", "another",
           "well", "large", "must", "even", "such", "because", "turn", "here", "why", "ask",
           "went", "men", "need", "land", "different", "home", "us", "move", "try", "kind",
           "hand", "picture", "again", "change", "off", "play", "spell", "air", "away",
           "animal", "point", "page", "letter", "found", "study", "still", "learn", "should",
           "America", "world", "high", "every", "near", "add", "between", "own", "below",
           "country", "plant", "last", "keep", "eye", "never", "thought", "city", "earth",
           "head", "under", "story", "saw", "left", "few", "while", "along", "might", "close",
           "something", "seem", "next", "example", "begin", "life", "always", "those",
           "both", "paper", "together", "got", "group", "often", "run", "important", "until",
           "children", "side", "feet", "car", "mile", "night", "walk", "white", "sea", "began",
           "grow", "took", "four", "carry", "state", "once", "hear", "stop", "without",
           "second", "later", "miss", "idea", "enough", "eat", "face", "watch", "far",
           "really", "almost", "let", "above", "girl", "sometimes", "young", "talk", "soon",
           "list", "song", "being", "leave", "family", "body", "color", "stand", "questions",
           "fish", "area", "mark", "horse", "birds", "problem", "complete", "room", "knew",
           "since", "ever", "piece", "told", "usually", "didn't", "friends", "easy", "heard",
           "order", "door", "sure", "become", "top", "ship", "across", "today", "during",
           "however", "system", "government", "information", "company", "research", "model")
_NAMES = ("Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Anna", "Tom")
_POSITIVE = ("good", "great", "wonderful", "excellent", "happy", "beautiful", "friendly")
_NEGATIVE = ("bad", "terrible", "awful", "poor", "sad", "boring")


_YES_NO, _YES_NO_CAP = ("yes", "no"), ("Yes", "No")
_TRUE_FALSE, _TRUE_FALSE_CAP = ("true", "false"), ("True", "False")
_LETTERS = ("A", "B", "C", "D")
_SENTIMENTS = ("positive", "negative", "neutral")
_NEUTRAL = ("ok", "fine", "normal")


def _sentence(rng: np.random.Generator) -> str:
    """One line of the tokenizer corpus; templates lean on evaluation-style answers."""
    def pick(options: tuple[str, ...]) -> str:
        return options[int(rng.integers(len(options)))]

    noun, other, adj = pick(_NOUNS), pick(_NOUNS), pick(_ADJECTIVES)
    verb, name = pick(_VERBS), pick(_NAMES)
    template = int(rng.integers(11))
    if template == 0:
        return f"Question: Is the {noun} {adj}? Answer: {pick(_YES_NO)}"
    if template == 1:
        tone = pick(_SENTIMENTS)
        word = pick({"positive": _POSITIVE, "negative": _NEGATIVE, "neutral": _NEUTRAL}[tone])
        return f"Review: The {noun} was {word}. Sentiment: {tone}"
    if template == 2:
        options = " ".join(f"{letter}) the {pick(_NOUNS)}" for letter in _LETTERS)
        return f"Which one is {adj}? {options} Answer: {pick(_LETTERS)}"
    if template == 3:
        return f"True or false: {name} {verb} the {noun}. Answer: {pick(_TRUE_FALSE)}"
    if template == 4:
        return f"{pick(_YES_NO_CAP)}, the {noun} is {adj}. {pick(_TRUE_FALSE_CAP)}."
    if template == 5:
        a, b = int(rng.integers(100)), int(rng.integers(100))
        return f"What is {a} plus {b}? The answer is {a + b}."
    if template == 6:
        return f"{name} {verb} the {adj} {noun} and the {other}, so the answer is {pick(_LETTERS)}."
    if template == 7:
        return f"The {noun} is {adj}: {pick(_YES_NO)} or {pick(_YES_NO)}?"
    if template == 8:
        return (f"Is this review positive or negative? \"A {adj} {noun}.\" "
                f"It is {pick(_SENTIMENTS[:2])}.")
    if template == 9:
        words = " ".join(pick(_COMMON) for _ in range(int(rng.integers(6, 16))))
        return words[0].upper() + words[1:] + pick((".", "?", "!", ","))
    first, second = pick(_COMMON), pick(_COMMON)
    return f"{name} asked: {first} {second}? {pick(_YES_NO_CAP)} or {pick(_YES_NO_CAP)}."


def demo_corpus(seed: int = DEMO_SEED, lines: int = 6000) -> Iterator[str]:
    """The deterministic training corpus of the demo tokenizer (no files are read)."""
    rng = np.random.default_rng(seed)
    for _ in range(lines):
        yield _sentence(rng)


def build_demo_tokenizer(vocab_size: int = 1024, seed: int = DEMO_SEED):
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
    tokenizer.train_from_iterator(demo_corpus(seed), trainer=trainer)
    return tokenizer


# =========================================================================== weights
def demo_weights(cfg: ModelConfig, seed: int = DEMO_SEED) -> dict[str, np.ndarray]:
    """HF-named float32 tensors for ``cfg``: N(0, 1) * WEIGHT_SCALE, norm weights 1.0.

    The names and shapes are the loader's own plan (per-expert spelling), so the demo
    checkpoint is exactly what :func:`moejax.checkpoint.load_hf_params` expects. Tensors
    are drawn in sorted-name order from one ``default_rng(seed)`` stream.
    """
    shapes = {slot.name: slot.shape for slot in hf_tensor_plan(cfg, set())}
    rng = np.random.default_rng(seed)
    tensors = {}
    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            tensors[name] = np.ones(shapes[name], np.float32)
        else:
            tensors[name] = rng.standard_normal(shapes[name], dtype=np.float32) * WEIGHT_SCALE
    return tensors


# =========================================================================== cache
def default_cache_root() -> str:
    """``$MOEJAX_CACHE``, else ``~/.cache/moejax``."""
    return os.environ.get("MOEJAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                          "moejax")


def _complete(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, name)) for name in _FILES)


def write_demo_model(out_dir: str) -> None:
    """Write the three demo files into the existing directory ``out_dir``."""
    hf_config = demo_config_dict()
    cfg = from_hf_dict(hf_config)
    tokenizer = build_demo_tokenizer(cfg.vocab_size)
    if tokenizer.get_vocab_size() != cfg.vocab_size:
        raise RuntimeError(f"demo tokenizer has {tokenizer.get_vocab_size()} tokens but "
                           f"{DEMO_CONFIG_PATH} says vocab_size {cfg.vocab_size}")
    for key, token in (("bos_token_id", "<|endoftext|>"), ("eos_token_id", "<|endoftext|>"),
                       ("pad_token_id", "<|pad|>")):
        if hf_config.get(key) != tokenizer.token_to_id(token):
            raise RuntimeError(f"{DEMO_CONFIG_PATH}: {key} should be the id of {token}")
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as fh:
        json.dump(hf_config, fh, indent=2, sort_keys=True)
        fh.write("\n")
    write_safetensors(os.path.join(out_dir, "model.safetensors"), demo_weights(cfg),
                      metadata={"format": "pt", "notice": DEMO_NOTICE})


def ensure_demo_model(cache_dir: str | os.PathLike | None = None) -> str:
    """Path of the demo model directory ``<cache>/demo-v1``, creating it on first use.

    ``cache_dir`` is the cache root (default :func:`default_cache_root`). The files are
    written into a temporary sibling and renamed into place, so concurrent first uses are
    safe: one rename wins and the others discard their copy.
    """
    root = os.path.abspath(os.fspath(cache_dir) if cache_dir is not None else default_cache_root())
    final = os.path.join(root, DEMO_NAME)
    if _complete(final):
        return final
    if os.path.exists(final):  # renames are atomic, so this is not a first use in progress
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
