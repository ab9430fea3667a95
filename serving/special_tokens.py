"""What a model directory's ``tokenizer_config.json`` says about special tokens: the file
itself (:func:`read_tokenizer_config`), a token's text in either of its spellings
(:func:`token_text`) and the tokens a text prompt starts with (:func:`prompt_prefix`: a
BOS, as ``transformers``' tokenizer adds it with ``add_special_tokens=True``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

CONFIG_FILE = "tokenizer_config.json"


def read_tokenizer_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    """The directory's ``tokenizer_config.json`` ({} when it has none)."""
    path = Path(model_dir) / CONFIG_FILE
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def token_text(value: Any) -> str | None:
    """A special token's text: a string, or an added-token object's ``content``."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def prompt_prefix(tokenizer: Any, config: Mapping[str, Any]) -> tuple[int, ...]:
    """The special tokens a text prompt starts with (``tokenizer``: a
    ``tokenizers.Tokenizer``). ``add_bos_token`` in the config decides when it is there
    (true: ``bos_token``'s id; false: none); without it, what the tokenizer's own
    post-processor puts before the text (a Llama-style ``<s> $A`` template: its BOS).
    Tokens a post-processor appends (an EOS) are not a prompt's: a prompt is continued."""
    flag = config.get("add_bos_token")
    if flag is not None:
        if not flag:
            return ()
        bos = token_text(config.get("bos_token"))
        bos_id = None if bos is None else tokenizer.token_to_id(bos)
        if bos_id is None:
            raise ValueError(f"{CONFIG_FILE}: add_bos_token is true but its bos_token "
                             f"({bos!r}) is not a token of tokenizer.json")
        return (int(bos_id),)
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return tuple(int(t) for t in full[:start])
    return ()


__all__ = ("CONFIG_FILE", "prompt_prefix", "read_tokenizer_config", "token_text")
