"""A text prompt starts with the special tokens its tokenizer config asks for (a BOS):
``tokenizer_config.json``'s ``add_bos_token``, else the tokenizer's post-processor (held to
``transformers``' tokenizer on the same files); candidates, ids and chat-rendered prompts
get none; ``add_special_tokens: false`` leaves it out; scoring, generation and gRPC agree."""

from __future__ import annotations

import json
import shutil

import pytest

from moejax.checkpoint import load_tokenizer
from serving import Scorer
from serving.generate import Generator
from serving.grpc.convert import (generation_request_from_proto, generation_request_to_proto,
                                  request_from_proto, request_to_proto)
from serving.requests import TokenizerAdapter, parse_request
from serving.special_tokens import prompt_prefix

BOS = "<|endoftext|>"          # the demo tokenizer's id 0
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt "
          "%}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TEXT = "def add(a, b):\n    return a + b"


def demo_dir(tmp_path, config=None, post_processor=False):
    """The demo model's files, with a tokenizer config and (``post_processor``) a
    Llama-style ``BOS $A`` post-processor in tokenizer.json."""
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copy(f"moejax/demo/weights/{name}", tmp_path / name)
    if post_processor:
        from tokenizers import processors

        tokenizer = load_tokenizer(tmp_path)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", special_tokens=[(BOS, tokenizer.token_to_id(BOS))])
        tokenizer.save(str(tmp_path / "tokenizer.json"))
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_post_processor_bos_is_what_transformers_adds(tmp_path):
    from transformers import AutoTokenizer

    directory = demo_dir(tmp_path, {"bos_token": BOS}, post_processor=True)
    ours = TokenizerAdapter.from_model_dir(directory, load_tokenizer(directory))
    # The tokenizer's files alone: beside the demo's config.json, transformers would take
    # the tokenizer class of its model type, whose own pre-tokenizer splits otherwise.
    alone = tmp_path / "tokenizer-only"
    alone.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(directory / name, alone / name)
    theirs = AutoTokenizer.from_pretrained(str(alone))
    assert ours.prompt_prefix == (0,)
    assert ours.encode_prompt(TEXT) == theirs(TEXT)["input_ids"]
    assert ours.encode_prompt(TEXT, False) == theirs(TEXT, add_special_tokens=False)["input_ids"]
    assert ours.encode(TEXT) == ours.encode_prompt(TEXT)[1:]    # candidates: never


def test_add_bos_token_in_the_config_decides(tmp_path):
    tokenizer = load_tokenizer(demo_dir(tmp_path))
    assert prompt_prefix(tokenizer, {}) == ()                      # no post-processor BOS
    assert prompt_prefix(tokenizer, {"add_bos_token": True, "bos_token": BOS}) == (0,)
    assert prompt_prefix(tokenizer, {"add_bos_token": True,
                                     "bos_token": {"content": "<|im_start|>"}}) == (
        tokenizer.token_to_id("<|im_start|>"),)
    (tmp_path / "p").mkdir()
    processed = load_tokenizer(demo_dir(tmp_path / "p", post_processor=True))
    assert prompt_prefix(processed, {"add_bos_token": False}) == ()   # the flag wins
    with pytest.raises(ValueError, match="add_bos_token is true but its bos_token "
                                         "\\('<s>'\\) is not a token of tokenizer.json"):
        prompt_prefix(tokenizer, {"add_bos_token": True, "bos_token": "<s>"})


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory):
    """The demo model whose tokenizer config asks for a BOS, with a chat template."""
    directory = demo_dir(tmp_path_factory.mktemp("bos"), {
        "add_bos_token": True, "bos_token": BOS, "chat_template": CHATML})
    scorer = Scorer(str(directory), calibrate=False, max_batch_tokens=128)
    return directory, scorer


def test_scoring_prompts_start_with_the_bos_unless_asked_not_to(bos_model):
    _, scorer = bos_model
    plain = scorer.tokenizer.encode(TEXT)
    with_bos, without, ids, chat, classify = scorer.score([
        {"kind": "prompt_logprobs", "prompt": TEXT},
        {"kind": "prompt_logprobs", "prompt": TEXT, "add_special_tokens": False},
        {"kind": "prompt_logprobs", "prompt_token_ids": plain},
        {"kind": "prompt_logprobs", "messages": [{"role": "user", "content": "hi"}]},
        {"prompt": TEXT, "candidates": [" a", " b"]}])
    assert with_bos.token_ids == [0, *plain] and without.token_ids == plain
    assert ids.token_ids == plain                                # ids: taken as they are
    rendered = scorer.tokenizer.chat_template.render([{"role": "user", "content": "hi"}],
                                                     add_generation_prompt=False)
    assert chat.token_ids == scorer.tokenizer.encode(rendered)   # the template's own
    assert classify.prompt_tokens == len(plain) + 1
    # The BOS changes the numbers: the model reads the prompt after it.
    assert with_bos.logprobs[1:] != pytest.approx(without.logprobs, abs=1e-6)
    (bad,) = scorer.score([{"prompt": TEXT, "candidates": [" a"], "add_special_tokens": 1}])
    assert bad.error == "request #0: add_special_tokens: must be true or false, got int"


def test_generation_prompts_start_with_the_bos_too(bos_model):
    directory, scorer = bos_model
    generator = Generator(str(directory), share_with=scorer)
    with_bos, without = generator.generate([
        {"prompt": TEXT, "max_new_tokens": 2, "temperature": 0},
        {"prompt": TEXT, "max_new_tokens": 2, "temperature": 0, "add_special_tokens": False}])
    assert with_bos.prompt_tokens == without.prompt_tokens + 1


def test_add_special_tokens_travels_over_grpc():
    request = parse_request({"prompt": "x", "candidates": [" a"], "add_special_tokens": False},
                            0)
    assert request_from_proto(request_to_proto(request)) == request
    sent = {"prompt": "x", "add_special_tokens": False}
    assert generation_request_from_proto(generation_request_to_proto(sent)) == sent
