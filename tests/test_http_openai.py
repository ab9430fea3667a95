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
OTHER = "import os\n"
# Log-probabilities over HTTP against the in-process scorer's: the server's batches pack
# the tokens otherwise (another block size, other neighbours), which moves f32 sums.
TOL = 2e-5
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
    # What the log-probabilities must equal: the scoring engine's, in process.
    prompt_ids = scorer.tokenizer.encode(PROMPT)
    chat_ids = scorer.tokenizer.encode(rendered)
    expected = dict(zip(("prompt", "completion", "chat", "loglikelihood"), scorer.score([
        {"kind": "prompt_logprobs", "prompt": PROMPT, "top_logprobs": 2},
        {"kind": "prompt_logprobs", "prompt_token_ids": prompt_ids + want[0].token_ids,
         "top_logprobs": 2},
        {"kind": "prompt_logprobs", "prompt_token_ids": chat_ids + want[1].token_ids,
         "top_logprobs": 2},
        {"prompt_token_ids": prompt_ids[:4], "candidate_token_ids": [prompt_ids[4:]],
         "normalize": "vocab"}])))
    expected["other"] = generator.generate([{"prompt": OTHER, "max_new_tokens": TOKENS,
                                             "temperature": 0}])[0]
    grpc_server = ScoringServer(ServerOptions(port=0, grace_seconds=5))
    grpc_server.start()
    expected["server"] = grpc_server
    http = HttpServer(grpc_server, HttpOptions(port=0))
    http.start()
    grpc_server.attach(scorer, generator)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http.port}/v1", api_key="unused",
                           max_retries=0, timeout=120)
    try:
        yield client, want, expected
    finally:
        grpc_server.stop(2)
        http.stop(5)


def test_completions_equal_the_generator(served):
    client, (want, _), _ = served
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
    client, (_, want), _ = served
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
    client, (want, _), _ = served
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
    client, _, _ = served
    for options, named in (({"n": 9, "prompt": [PROMPT, OTHER]}, "more than one call takes"),
                           ({"logprobs": 1, "stream": True}, "logprobs: log-probabilities "
                                                             "are given by non-streamed"),
                           ({"echo": True, "stream": True}, "echo: echo is given by"),
                           ({"max_tokens": 0}, "max_tokens: 0 generates nothing"),
                           ({"logprobs": 21}, "logprobs"),
                           ({"n": 17}, "n")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(**{"model": "demo", "prompt": PROMPT, "max_tokens": 4,
                                         **options})
        assert named in str(refused.value), (options, str(refused.value))
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="demo", messages=CHAT, max_tokens=4,
                                       top_logprobs=2)
    assert "top_logprobs: needs logprobs: true" in str(refused.value)
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

    client, _, _ = served
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
    # The decode load, per (layer, expert): k choices per decode row counted.
    with urllib.request.urlopen(base + "/metrics", timeout=60) as answer:
        families = list(text_string_to_metric_families(answer.read().decode()))
    decode = [s for f in families for s in f.samples
              if s.name == "moejax_expert_tokens_total" and s.labels["phase"] == "decode"]
    assert decode and {s.labels["layer"] for s in decode} == {"0", "1", "2", "3"}
    per_layer = {}
    for s in decode:
        per_layer[s.labels["layer"]] = per_layer.get(s.labels["layer"], 0) + s.value
    assert len(set(per_layer.values())) == 1 and list(per_layer.values())[0] % 2 == 0
    assert moved("moejax_generation_time_to_first_token_seconds_count") == 1
    assert 1 <= moved("moejax_generation_time_per_output_token_seconds_count") <= tokens - 1
    assert after["moejax_kv_blocks_in_use"] == 0 and after["moejax_generation_streams"] == 0


def legacy_entries(logprobs) -> list:
    return list(zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs))


def test_echo_with_logprobs_gives_the_prompt_logprobs_lm_eval_reads(served):
    """lm-evaluation-harness's loglikelihood request (token-id prompts in a batch, echo,
    logprobs=1, max_tokens 1 or 0): the prompt's log-probabilities are the scoring
    engine's, the first token's is null, and the continuation's sum and greediness read
    as lm-eval reads them."""
    client, (want, _), expected = served
    prompt = expected["prompt"]
    ids = prompt.token_ids
    # Text prompt, nothing generated: the text is the prompt.
    got = client.completions.create(model="demo", prompt=PROMPT, echo=True, logprobs=2,
                                    max_tokens=0)
    (choice,) = got.choices
    assert choice.text == PROMPT and got.usage.prompt_tokens == len(ids)
    assert got.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(prompt.logprobs, abs=TOL)
    assert "".join(lp.tokens) == PROMPT and lp.text_offset[0] == 0
    for i, (token, logprob, top) in enumerate(legacy_entries(lp)[1:]):
        best = dict(zip(prompt.top_token_ids[i], prompt.top_logprobs[i]))
        assert max(top.values()) == pytest.approx(max(best.values()), abs=TOL)
        assert top[token] == pytest.approx(logprob, abs=TOL)   # the token itself is there
        assert 2 <= len(top) <= 3
    # lm-eval's batch: token-id prompts, max_tokens=1, logprobs=1.
    context = 4
    batch = client.completions.create(model="demo", prompt=[ids, ids[:6]], echo=True,
                                      logprobs=1, max_tokens=1, temperature=0, seed=1234)
    assert [c.index for c in batch.choices] == [0, 1]
    first = batch.choices[0].logprobs
    assert len(first.token_logprobs) == len(ids) + 1          # the prompt and one token
    assert first.token_logprobs[1:len(ids)] == pytest.approx(prompt.logprobs, abs=TOL)
    continuation = first.token_logprobs[context:-1]
    assert sum(continuation) == pytest.approx(expected["loglikelihood"].logprobs[0],
                                              abs=TOL)
    greedy = all(lp == max(top.values()) for lp, top in
                 zip(continuation, first.top_logprobs[context:-1]))
    # lm-eval's greediness: each continuation token is the most likely there.
    assert greedy == all(prompt.top_token_ids[i][0] == ids[i + 1]
                         for i in range(context - 1, len(ids) - 1))
    second = batch.choices[1].logprobs
    assert second.token_logprobs[1:6] == pytest.approx(prompt.logprobs[:5], abs=TOL)


def test_completion_logprobs_are_the_generated_tokens_scored(served):
    client, (want, _), expected = served
    scored = expected["completion"]
    prompt_len = len(expected["prompt"].token_ids)
    got = client.completions.create(model="demo", prompt=PROMPT, max_tokens=TOKENS,
                                    temperature=0, logprobs=2)
    (choice,) = got.choices
    assert choice.text == want.text
    lp = choice.logprobs
    assert len(lp.tokens) == got.usage.completion_tokens == len(want.token_ids)
    assert lp.token_logprobs == pytest.approx(scored.logprobs[prompt_len - 1:], abs=TOL)
    assert "".join(lp.tokens) == want.text and lp.text_offset[0] == 0
    # Echoed, the same numbers follow the prompt's.
    echoed = client.completions.create(model="demo", prompt=PROMPT, max_tokens=TOKENS,
                                       temperature=0, logprobs=2, echo=True).choices[0]
    assert echoed.text == PROMPT + want.text
    assert echoed.logprobs.token_logprobs[1:] == pytest.approx(scored.logprobs, abs=TOL)
    assert echoed.logprobs.text_offset[prompt_len] == len(PROMPT)


def test_chat_logprobs_are_the_reply_tokens_scored(served):
    client, (_, want), expected = served
    scored = expected["chat"]
    got = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=TOKENS,
                                         temperature=0, logprobs=True, top_logprobs=2)
    (choice,) = got.choices
    assert choice.message.content == want.text
    content = choice.logprobs.content
    assert len(content) == len(want.token_ids)
    reply = scored.logprobs[-len(want.token_ids):]
    assert [c.logprob for c in content] == pytest.approx(reply, abs=TOL)
    tops = scored.top_logprobs[-len(want.token_ids):]
    for entry, best in zip(content, tops):
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(best, abs=TOL)
        assert bytes(entry.bytes).decode() == entry.token


def test_several_prompts_and_n_choices_are_indexed_streamed_and_not(served):
    client, (want, _), expected = served
    other = expected["other"]
    got = client.completions.create(model="demo", prompt=[PROMPT, OTHER], n=2,
                                    max_tokens=TOKENS, temperature=0)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert [c.text for c in got.choices] == [want.text, want.text, other.text, other.text]
    assert got.usage.completion_tokens == 2 * (len(want.token_ids) + len(other.token_ids))
    assert got.usage.prompt_tokens == (len(expected["prompt"].token_ids)
                                       + other.prompt_tokens)
    # Sampled, the n choices of a prompt take seeds seed, seed + 1: they differ from each
    # other and each equals a single call with its own seed.
    sampled = client.completions.create(model="demo", prompt=PROMPT, n=2, max_tokens=TOKENS,
                                        temperature=1.5, seed=5)
    alone = [client.completions.create(model="demo", prompt=PROMPT, max_tokens=TOKENS,
                                       temperature=1.5, seed=seed).choices[0].text
             for seed in (5, 6)]
    assert [c.text for c in sampled.choices] == alone
    # Streamed: each index's chunks make its text; the usage chunk counts them all.
    texts: dict[int, str] = {}
    finished = {}
    for chunk in client.completions.create(model="demo", prompt=[PROMPT, OTHER], n=2,
                                           max_tokens=TOKENS, temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finished[c.index] = c.finish_reason
        usage = chunk.usage
    assert texts == {0: want.text, 1: want.text, 2: other.text, 3: other.text}
    assert finished == {i: r for i, r in enumerate([want.finish_reason] * 2
                                                   + [other.finish_reason] * 2)}
    assert usage.completion_tokens == got.usage.completion_tokens
    chat = client.chat.completions.create(model="demo", messages=CHAT, n=2,
                                          max_tokens=TOKENS, temperature=0)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content


def test_a_call_over_the_stream_limit_is_refused_whole_and_gives_its_slots_back(served):
    client, (want, _), expected = served
    service = expected["server"].generation
    limit = service.max_streams
    service.max_streams = 3
    try:
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model="demo", prompt=PROMPT, n=4, max_tokens=TOKENS,
                                      temperature=0)
        assert int(refused.value.response.headers["retry-after"]) >= 1
        assert service.streams == 0                 # the three opened were given back
        got = client.completions.create(model="demo", prompt=PROMPT, n=3, max_tokens=TOKENS,
                                        temperature=0)
        assert [c.text for c in got.choices] == [want.text] * 3
    finally:
        service.max_streams = limit
