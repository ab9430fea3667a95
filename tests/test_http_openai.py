"""The official ``openai`` client against the HTTP door's completions and chat completions
(serving/http/openai_compat.py), streamed and not: the text equals the in-process
Generator's greedy text for the same prompt (chat: the prompt the model's chat template
renders), and what is not supported is refused by name."""

from __future__ import annotations

import json
import shutil

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from serving import Scorer  # noqa: E402
from serving.chat import ChatTemplate  # noqa: E402
from serving.generate import Generator  # noqa: E402
from serving.grpc.server import ScoringServer, ServerOptions  # noqa: E402
from serving.http import HttpOptions, HttpServer  # noqa: E402

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt "
          "%}{{ '<|im_start|>assistant\\n' }}{% endif %}")
PROMPT = "def add(a, b):\n    return"
CHAT = [{"role": "user", "content": "Complete: 2 + 3 ="}]
TOKENS = 8


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A server of the demo model with a chat template, over gRPC and HTTP, and the
    in-process Generator's greedy text of PROMPT and of CHAT (before the server owns it)."""
    directory = tmp_path_factory.mktemp("chat-demo")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copy(f"moejax/demo/weights/{name}", directory / name)
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    scorer = Scorer(str(directory), calibrate=False, max_batch_tokens=128)
    generator = Generator(str(directory), share_with=scorer)
    rendered = ChatTemplate.from_model_dir(directory).render(CHAT)
    want = generator.generate([{"prompt": PROMPT, "max_new_tokens": TOKENS, "temperature": 0},
                               {"prompt": rendered, "max_new_tokens": TOKENS,
                                "temperature": 0}])
    grpc_server = ScoringServer(ServerOptions(port=0, grace_seconds=5))
    grpc_server.start()
    http = HttpServer(grpc_server, HttpOptions(port=0))
    http.start()
    grpc_server.attach(scorer, generator)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http.port}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    try:
        yield client, want
    finally:
        grpc_server.stop(2)
        http.stop(5)


def test_completions_equal_the_generator(served):
    client, (want, _) = served
    got = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT,
                                    max_tokens=TOKENS, temperature=0)
    assert got.object == "text_completion" and got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == want.prompt_tokens
    assert got.usage.completion_tokens == len(want.token_ids)
    chunks = list(client.completions.create(model="demo", prompt=PROMPT, max_tokens=TOKENS,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == want.finish_reason and set(finishes[:-1]) <= {None}
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_chat_completions_render_the_template(served):
    client, (_, want) = served
    got = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=TOKENS,
                                         temperature=0)
    message = got.choices[0].message
    assert got.object == "chat.completion" and message.role == "assistant"
    assert message.content == want.text
    chunks = list(client.chat.completions.create(model="demo", messages=CHAT,
                                                 max_tokens=TOKENS, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason


def test_a_stop_string_ends_the_text_before_it(served):
    """``stop``: the text ends before the first stop string (not returned), finish_reason
    "stop", streamed and not; the sequence is cancelled there."""
    client, (want, _) = served
    # The first three non-blank characters after the start: inside the text, not at 0.
    stop = next(want.text[i:i + 3] for i in range(2, len(want.text) - 2)
                if not any(c.isspace() for c in want.text[i:i + 3]))
    expected = want.text[:want.text.find(stop)]
    for stops in ([stop], ["never seen", stop]):
        got = client.completions.create(model="demo", prompt=PROMPT, max_tokens=TOKENS,
                                        temperature=0, stop=stops)
        assert got.choices[0].text == expected and got.choices[0].finish_reason == "stop"
        assert got.usage.completion_tokens <= len(want.token_ids)
        chunks = list(client.completions.create(model="demo", prompt=PROMPT,
                                                max_tokens=TOKENS, temperature=0,
                                                stop=stops, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == expected
        assert chunks[-1].choices[0].finish_reason == "stop"
    # A stop string the text never holds changes nothing.
    got = client.completions.create(model="demo", prompt=PROMPT, max_tokens=TOKENS,
                                    temperature=0, stop="never seen")
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason


def test_what_is_not_supported_is_refused_by_name(served):
    client, _ = served
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="demo", prompt=PROMPT, max_tokens=4, n=2)
    assert "only n=1" in str(refused.value)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="demo", prompt=PROMPT, max_tokens=4,
                                  stop=["a", "b", "c", "d", "e"])
    assert "at most 4" in str(refused.value)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="demo", prompt=PROMPT, max_tokens=4, temperature=-1)
    assert "temperature" in str(refused.value)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="demo", messages=[{"role": "user"}],
                                       max_tokens=4)
    assert "content" in str(refused.value) or "messages" in str(refused.value)


def test_generation_metrics_move_by_the_tokens_generated(served):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    client, _ = served
    base = str(client.base_url).rstrip("/").removesuffix("/v1")

    def samples():
        with urllib.request.urlopen(base + "/metrics", timeout=60) as answer:
            text = answer.read().decode()
        return {s.name: s.value for f in text_string_to_metric_families(text)
                for s in f.samples if not s.labels}      # (the unlabelled samples)

    before = samples()
    got = client.completions.create(model="demo", prompt=PROMPT, max_tokens=TOKENS,
                                    temperature=0)
    after = samples()

    def moved(name):
        return after.get(name, 0) - before.get(name, 0)

    tokens = got.usage.completion_tokens
    assert moved("moejax_generation_tokens_total") == tokens
    assert moved("moejax_generation_time_to_first_token_seconds_count") == 1
    assert 1 <= moved("moejax_generation_time_per_output_token_seconds_count") <= tokens - 1
    assert after["moejax_kv_blocks_in_use"] == 0 and after["moejax_generation_streams"] == 0
