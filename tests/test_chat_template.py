"""Chat templates (serving/chat.py) rendered against ``transformers``' own
``apply_chat_template`` on the same templates and messages, read from a model directory as
``transformers`` saves it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from serving.chat import ChatTemplate, ChatTemplateError

transformers = pytest.importorskip("transformers")
DEMO_TOKENIZER = "moejax/demo/weights/tokenizer.json"

CHATML = ("{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
          "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
LLAMA2 = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
          "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
          "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
          "{{ '[INST] ' + message['content'] | trim + ' [/INST]' }}{% elif message['role'] == "
          "'assistant' %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}{% endif %}"
          "{% endfor %}")
# Whitespace control, loop controls, tojson of non-ASCII text, a {% generation %} block.
BLOCKS = """{%- for message in messages %}
  {%- if message.role == 'system' %}{% continue %}{% endif %}
  <{{ message.role }}>{{ message.content | tojson }}
  {%- if message.role == 'assistant' %}
    {% generation %}{{ message.content }}{% endgeneration %}
  {%- endif %}
{% endfor %}
{%- if add_generation_prompt %}<assistant>{% endif %}"""

CHATS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Café ☕?"},
     {"role": "assistant", "content": " Yes, \"two\". "}, {"role": "user", "content": "And?"}],
]


def saved(tmp_path, template: str):
    """A tokenizer directory as transformers writes it, and the tokenizer."""
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=DEMO_TOKENIZER, bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = template
    tokenizer.save_pretrained(tmp_path)
    return tokenizer


@pytest.mark.parametrize("template", [CHATML, LLAMA2, BLOCKS], ids=["chatml", "llama2",
                                                                     "blocks"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_renders_as_transformers_does(tmp_path, template, generation_prompt):
    tokenizer = saved(tmp_path, template)
    ours = ChatTemplate.from_model_dir(tmp_path)
    assert ours is not None and ours.special_tokens["bos_token"] == "<s>"
    for chat in CHATS:
        if template is LLAMA2 and chat[0]["role"] == "system":
            continue      # (this template refuses a system message; tested below)
        want = tokenizer.apply_chat_template(chat, tokenize=False,
                                             add_generation_prompt=generation_prompt)
        assert ours.render(chat, add_generation_prompt=generation_prompt) == want


def test_the_template_s_own_refusal_and_bad_messages_are_errors(tmp_path):
    saved(tmp_path, LLAMA2)
    template = ChatTemplate.from_model_dir(tmp_path)
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        template.render([{"role": "assistant", "content": "first"}])
    with pytest.raises(ChatTemplateError, match=r"messages\[1\]\.role"):
        template.render([{"role": "user", "content": "a"}, {"content": "b"}])
    with pytest.raises(ChatTemplateError, match="non-empty"):
        template.render([])
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% for x in %}")


def test_the_template_may_sit_in_tokenizer_config_or_be_absent(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>",
        "chat_template": [{"name": "tool_use", "template": "tools"},
                          {"name": "default", "template": LLAMA2}]}))
    template = ChatTemplate.from_model_dir(tmp_path)
    assert template.render([{"role": "user", "content": " hi "}]) == "<s>[INST] hi [/INST]"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert ChatTemplate.from_model_dir(tmp_path) is None


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """The demo model's files with a ChatML template beside them (tokenizer_config.json)."""
    import shutil

    directory = tmp_path_factory.mktemp("chat-demo")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copy(f"moejax/demo/weights/{name}", directory / name)
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML,
                                                                "eos_token": "</s>"}))
    return directory


def test_scoring_messages_equals_scoring_the_rendered_prompt(chat_model):
    from serving import Scorer

    scorer = Scorer(str(chat_model), calibrate=False, max_batch_tokens=256,
                    max_text_bytes=400)
    chat = [{"role": "user", "content": "Is 2 + 2 = 4?"}]
    rendered = ChatTemplate.from_model_dir(chat_model).render(chat)
    assert rendered.endswith("<|im_start|>assistant\n")
    by_messages, by_prompt, *bad = scorer.score([
        {"id": "m", "messages": chat, "candidates": ["yes", "no"]},
        {"id": "p", "prompt": rendered, "candidates": ["yes", "no"]},
        {"id": "both", "messages": chat, "prompt": "x", "candidates": ["a"]},
        {"id": "role", "messages": [{"content": "hi"}], "candidates": ["a"]},
        {"id": "choice", "kind": "choice", "messages": chat, "candidates": ["a", "b"]},
        {"id": "big", "messages": [{"role": "user", "content": "x" * 500}], "candidates": ["a"]}])
    assert by_messages.error is None and by_messages.label == by_prompt.label
    # (equal up to packing: the two sit at other places of the batch)
    np.testing.assert_allclose(by_messages.logprobs, by_prompt.logprobs, rtol=1e-5)
    assert by_messages.prompt_tokens == by_prompt.prompt_tokens
    assert "messages: give only one of" in bad[0].error
    assert "messages[0].role" in bad[1].error
    assert "kind 'choice'" in bad[2].error
    assert "max_text_bytes" in bad[3].error


def test_messages_without_a_chat_template_are_refused_by_name():
    from serving import Scorer

    (result,) = Scorer("demo", calibrate=False, max_batch_tokens=64).score(
        [{"messages": [{"role": "user", "content": "hi"}], "candidates": [" a"]}])
    assert "messages: the model has no chat template" in result.error


def test_messages_and_templates_travel_over_grpc(chat_model):
    """ScoreRequest's messages and templates_json: a request sent by the gRPC client is
    answered as the in-process Scorer answers it."""
    from serving import Scorer
    from serving.grpc import Client
    from serving.grpc.server import ScoringServer, ServerOptions

    scorer = Scorer(str(chat_model), calibrate=False, max_batch_tokens=256)
    requests = [{"id": "m", "messages": [{"role": "user", "content": "Is 2 + 2 = 4?"}],
                 "candidates": ["yes", "no"]},
                {"id": "t", "kind": "choice", "prompt": "Which is a number?",
                 "candidates": ["seven", "table"],
                 "templates": {"choice_labels": ["1", "2"], "choice_template":
                               "Q: {prompt}\n{options}\nA:"}},
                {"id": "bad", "prompt": "x", "candidates": ["a"],
                 "templates": {"no_such_field": "y"}}]
    want = scorer.score(requests)
    server = ScoringServer(ServerOptions(port=0, generation=False))
    port = server.start()
    server.attach(scorer)
    try:
        with Client(f"127.0.0.1:{port}") as client:
            got = client.score(requests, timeout=60)
    finally:
        server.stop(2)
    for a, b in zip(got, want):
        assert a.error == b.error and a.label == b.label
        if b.error is None:
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5)
    assert "templates: unknown field 'no_such_field'" in got[2].error
