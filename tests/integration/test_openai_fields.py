"""What real clients send that the API used to refuse or answer wrongly (issue 36), on a real daemon
(CPU, tiny model) through the openai SDK: a list of prompts (lm-eval, LangChain ``OpenAI.batch``),
the SDK's own message objects sent back as history with the fields OpenAI documents, streamed
completion logprobs' ``text_offset``, errors in the client's words, strict types and duplicate keys."""

from __future__ import annotations

import json

import pytest

from tests.integration.agent_harness import Daemon, publish_tiny

openai = pytest.importorskip("openai")

MODEL = "tiny"
CTX = 256
EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def daemon(make_tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openai-fields")
    url = publish_tiny(make_tiny_model, tmp / "store", MODEL)
    d = Daemon(tmp, store_url=url,
               models=[{"name": MODEL, "preload": True, "max_model_len": CTX, "max_num_seqs": 8}])
    d.start(timeout=120)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def client(daemon):
    return openai.OpenAI(base_url=daemon.base + "/v1", api_key="unused", max_retries=0, timeout=60)


def _refused(daemon: Daemon, path: str, body: dict, param: str) -> str:
    code, resp = daemon.post(path, {"model": MODEL, **body})
    assert code == 400, (code, resp)
    assert resp["error"]["param"] == param, resp
    return resp["error"]["message"]


# --- item 2: a list of prompts -------------------------------------------------------------------


@pytest.mark.parametrize("prompts", [["hello there", "a b c"], [[5, 6, 7, 8], [9, 10], [11, 12, 13]]],
                         ids=["texts", "token-ids"])
def test_a_list_of_prompts_gets_n_choices_each_in_openai_order(client, prompts) -> None:
    kw = dict(model=MODEL, max_tokens=5, temperature=1.0, seed=11, n=2, extra_body=EOS)
    singles = [client.completions.create(prompt=p, **kw) for p in prompts]
    r = client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in r.choices] == list(range(2 * len(prompts)))
    # Prompt-major: choice j of prompt i is index i * n + j, and is what prompt i alone gives.
    assert [c.text for c in r.choices] == [c.text for s in singles for c in s.choices]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert r.usage.completion_tokens == 5 * 2 * len(prompts)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(client.completions.create(prompt=prompts, stream=True, stream_options={"include_usage": True}, **kw))
    texts: dict[int, str] = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
    assert [texts[i] for i in sorted(texts)] == [c.text for c in r.choices]
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_a_list_of_prompts_is_bounded(daemon) -> None:
    path = "/v1/completions"
    assert "64 prompts" in _refused(daemon, path, {"prompt": ["x"] * 65, "max_tokens": 1}, "prompt")
    assert "64 completions" in _refused(daemon, path, {"prompt": ["x"] * 9, "n": 8, "max_tokens": 1}, "n")
    _refused(daemon, path, {"prompt": ["x", [1, 2]], "max_tokens": 1}, "prompt")
    _refused(daemon, path, {"prompt": [[1, 2], []], "max_tokens": 1}, "prompt")
    _refused(daemon, path, {"prompt": [[1, 2], [1, "a"]], "max_tokens": 1}, "prompt")
    # Each prompt against the context, and every prompt's ids against the vocabulary.
    code, resp = daemon.post(path, {"model": MODEL, "prompt": [[5] * 8, [5] * (CTX + 4)], "max_tokens": 1})
    assert code == 400 and resp["error"]["code"] == "context_length_exceeded", resp
    _refused(daemon, path, {"prompt": [[5], [10 ** 6]], "max_tokens": 1}, "prompt")
    # 64 completions in one request are served.
    code, resp = daemon.post(path, {"model": MODEL, "prompt": [[5, 6]] * 32, "n": 2, "max_tokens": 1})
    assert code == 200 and len(resp["choices"]) == 64, resp


# --- item 4: fields OpenAI documents, and the SDK's own messages as history ----------------------


def test_the_sdks_own_message_goes_back_as_history(client) -> None:
    msgs = [{"role": "user", "content": "say something"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, extra_body=EOS)
    msgs.append(r.choices[0].message.model_dump())  # content, refusal, annotations, audio, function_call...
    assert {"refusal", "audio", "function_call", "annotations"} <= set(msgs[-1])
    msgs.append({"role": "user", "content": "and again"})
    r2 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, extra_body=EOS)
    assert r2.choices[0].finish_reason == "length"
    # A legacy function_call in the history is taken as the assistant's tool call.
    legacy = [{"role": "user", "content": "weather?"},
              {"role": "assistant", "content": None, "function_call": {"name": "get", "arguments": "{}"}},
              {"role": "user", "content": "thanks"}]
    assert client.chat.completions.create(model=MODEL, messages=legacy, max_tokens=2).choices


def test_harmless_top_level_fields_are_taken_and_ignored(client) -> None:
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, extra_body=EOS)
    plain = client.chat.completions.create(**kw)
    r = client.chat.completions.create(metadata={"team": "a"}, store=False, service_tier="auto",
                                       reasoning_effort="low", modalities=["text"], **kw)
    assert r.choices[0].message.content == plain.choices[0].message.content
    r = client.chat.completions.create(store=None, reasoning_effort=None, service_tier=None, **kw)
    assert r.choices[0].message.content == plain.choices[0].message.content


def test_fields_that_would_change_the_answer_are_refused(daemon) -> None:
    chat = "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    assert "text" in _refused(daemon, chat, {"messages": msgs, "modalities": ["text", "audio"]}, "modalities")
    assert "audio" in _refused(daemon, chat, {"messages": msgs + [
        {"role": "assistant", "content": "x", "audio": {"id": "audio_1"}}]}, "messages.1.audio")
    _refused(daemon, chat, {"messages": msgs, "reasoning_effort": "maximal"}, "reasoning_effort")
    _refused(daemon, chat, {"messages": msgs, "metadata": {"k": "v" * 513}}, "metadata.k")


# --- item 1: echo, prompt logprobs, max_tokens 0 (lm-eval's loglikelihood requests) ----------------------


def _hf_prompt_logprobs(make_tiny_model, ids: list[int]) -> list[float]:
    import torch
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(make_tiny_model("llama"), dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_lm_eval_loglikelihood_request_gets_the_prompts_logprobs(client, make_tiny_model) -> None:
    """lm-eval's request: token ids, echo, logprobs 1, max_tokens 0; it sums token_logprobs over
    the continuation and checks each against top_logprobs (is it the greedy one?)."""
    ctx, cont = [5, 6, 7, 8, 9], [10, 11, 12]
    r = client.completions.create(model=MODEL, prompt=[ctx + cont], echo=True, logprobs=1, max_tokens=0,
                                  temperature=0, seed=1234)
    c = r.choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = _hf_prompt_logprobs(make_tiny_model, ctx + cont)
    assert all(abs(g - w) < 1e-3 for g, w in zip(lp.token_logprobs[1:], want)), (lp.token_logprobs, want)
    assert all(len(t) == 1 and max(t.values()) >= v - 1e-6 for t, v in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]))
    assert "".join(lp.tokens) == c.text and c.finish_reason == "length"
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(8)]
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == 8
    # a batch of two, as lm-eval sends with --batch_size 2: each its own prompt's
    two = client.completions.create(model=MODEL, prompt=[ctx + cont, ctx], echo=True, logprobs=1, max_tokens=0)
    assert two.choices[0].logprobs.token_logprobs == lp.token_logprobs
    assert len(two.choices[1].logprobs.tokens) == len(ctx)


def test_echo_with_a_generated_answer_and_vllms_prompt_logprobs(client, daemon) -> None:
    kw = dict(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=3, temperature=0, extra_body=EOS)
    plain = client.completions.create(logprobs=2, **kw).choices[0]
    echoed = client.completions.create(echo=True, logprobs=2, **kw).choices[0]
    assert echoed.text.endswith(plain.text) and len(echoed.logprobs.tokens) == 4 + 3
    assert echoed.logprobs.token_logprobs[4:] == plain.logprobs.token_logprobs
    assert echoed.logprobs.text_offset[4:] == [o + len(echoed.text) - len(plain.text) for o in plain.logprobs.text_offset]
    text_only = client.completions.create(echo=True, **kw).choices[0]
    assert text_only.text == echoed.text and text_only.logprobs is None
    code, body = daemon.post("/v1/completions", {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 3,
                                                 "temperature": 0, "prompt_logprobs": 1, **EOS})
    assert code == 200, body
    plp = body["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == 4 and all(1 <= len(e) <= 2 for e in plp[1:])
    assert [e[str(t)]["logprob"] for e, t in zip(plp[1:], [6, 7, 8])] == echoed.logprobs.token_logprobs[1:4]
    assert body["choices"][0]["text"] == plain.text  # vLLM's field: the answer is not echoed
    _refused(daemon, "/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens")
    # streamed: the first chunk carries the prompt (and its logprobs), the rest as without echo
    chunks = list(client.completions.create(echo=True, logprobs=2, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == echoed.text
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == echoed.logprobs.token_logprobs
    offsets = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.text_offset]
    assert offsets == echoed.logprobs.text_offset
    only = list(client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=0, echo=True, logprobs=1,
                                          stream=True))
    assert [c.choices[0].finish_reason for c in only] == ["length"] and only[0].choices[0].logprobs.token_logprobs[0] is None


# --- item 3: the sampling parameters every peer has ---------------------------------------------------


def test_penalties_bias_min_tokens_and_best_of_are_served(client, daemon) -> None:
    kw = dict(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=6, temperature=0)
    plain = client.completions.create(extra_body=EOS, **kw).choices[0]
    # A bias of +100 all but forces a token (the SDK's own field, string keys)
    forced = client.completions.create(logit_bias={"42": 100}, logprobs=1, extra_body=EOS, **kw).choices[0]
    assert forced.logprobs.tokens == [forced.logprobs.tokens[0]] * 6 and forced.text != plain.text
    r = client.completions.create(presence_penalty=0.5, frequency_penalty=0.5, best_of=2, n=2,
                                  extra_body={"repetition_penalty": 1.3, "min_tokens": 3, **EOS}, **kw)
    assert [c.finish_reason for c in r.choices] == ["length", "length"] and r.usage.completion_tokens == 12
    code, body = daemon.post("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"999999": 1}})
    assert code == 400 and "logit_bias" in body["error"]["message"], body
    # named as the field it is, as every other logit_bias refusal (it once came back param null)
    assert (body["error"]["param"], body["error"]["code"]) == ("logit_bias", "invalid_value"), body
    assert _refused(daemon, "/v1/completions", {"prompt": "x", "best_of": 3}, "best_of").startswith("best_of: only")
    _refused(daemon, "/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "min_tokens")


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_holds_stop_strings_back_as_vllm_does(client, stream) -> None:
    """vLLM looks for stop strings only from the step that passes min_tokens on: a stop string in
    the first min_tokens tokens' text does not end the answer (once one token and "")."""
    kw = dict(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=12, temperature=0, logprobs=1, extra_body=EOS)
    free = client.completions.create(**kw).choices[0]
    tokens = free.logprobs.tokens
    first = next(t for t in tokens[:4] if t.strip())  # a stop string in the text of the first tokens
    stop = first.strip()[:1]
    at = next(k for k, t in enumerate(tokens) if stop in t)

    def answer(min_tokens: int):
        extra = {**EOS, "min_tokens": min_tokens} if min_tokens else EOS
        r = client.completions.create(stop=[stop], stream=stream, **{**kw, "extra_body": extra})
        if not stream:
            return r.choices[0].text, r.choices[0].finish_reason
        chunks = list(r)
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

    text, finish = answer(0)
    assert finish == "stop" and text == "".join(tokens[:at]) + tokens[at].split(stop)[0]
    later = [k for k, t in enumerate(tokens) if k > at and stop in t]
    text, finish = answer(at + 1)  # past the token that held it: no stop there
    assert text.startswith("".join(tokens[:at + 1]))
    if later:
        assert finish == "stop" and len(text) < len(free.text)
    else:
        assert finish == "length" and text == free.text


# --- item 5: streamed text_offset -------------------------------------------------------------------


def test_streamed_completion_text_offset_counts_from_the_answers_start(client) -> None:
    kw = dict(model=MODEL, prompt="offsets", max_tokens=10, temperature=0, logprobs=1, extra_body=EOS)
    whole = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, **kw))
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert len(chunks) > 2 and tokens == whole.logprobs.tokens
    assert offsets == whole.logprobs.text_offset == [sum(map(len, tokens[:i])) for i in range(len(tokens))]


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_logprobs_end_where_a_stop_string_cuts_the_text(client, echo) -> None:
    """The token a stop string lands in shows the text it kept (as in the whole answer), and no
    token after it: ``"".join(tokens) == text`` streamed too (a second attacker's finding: the
    last chunk had text "" and tokens ["en"])."""
    stopped = 0
    for seed in range(12):
        kw = dict(model=MODEL, prompt="hello world", max_tokens=30, temperature=1.0, seed=seed, logprobs=1,
                  echo=echo, stop=["e", "a "])
        whole = client.completions.create(**kw).choices[0]
        chunks = list(client.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks)
        tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
        assert text == whole.text and "".join(tokens) == text == "".join(whole.logprobs.tokens)
        assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset
        stopped += whole.finish_reason == "stop"
    assert stopped >= 6  # the stop strings did cut most answers


def test_streamed_chat_logprobs_equal_the_whole_answers_at_a_stop_string(client) -> None:
    stopped = 0
    for seed in range(8):
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=30, temperature=1.0,
                  seed=seed, logprobs=True, top_logprobs=1, stop=["e", "a "])
        whole = client.chat.completions.create(**kw).choices[0]
        chunks = list(client.chat.completions.create(stream=True, **kw))
        streamed = [t.token for c in chunks if c.choices and c.choices[0].logprobs
                    for t in c.choices[0].logprobs.content]
        assert streamed == [t.token for t in whole.logprobs.content]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.message.content
        stopped += whole.finish_reason == "stop"
    assert stopped >= 4


# --- item 10: errors in the client's words -------------------------------------------------------------


def test_unsupported_fields_say_so(daemon) -> None:
    msg = _refused(daemon, "/v1/completions", {"prompt": "x", "logit_bias": {"x50": 5}}, "logit_bias")
    assert "keys are token ids" in msg and "Dictionary" not in msg
    msg = _refused(daemon, "/v1/completions", {"prompt": "x", "suffix": "end"}, "suffix")
    assert msg.startswith("suffix is not supported") and "String should" not in msg
    msg = _refused(daemon, "/v1/completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens")
    assert msg == "max_tokens: must be an integer"


# --- item 17: strict types, duplicate keys --------------------------------------------------------------


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/completions", {"max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"n": True}, "n"),
    ("/v1/completions", {"stream": "false"}, "stream"),
    ("/v1/completions", {"temperature": "0.5"}, "temperature"),
    ("/v1/chat/completions", {"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "strict": "false"}}]},
     "tools.0.function.strict"),
])
def test_types_are_strict(daemon, path, extra, param) -> None:
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    _refused(daemon, path, {"max_tokens": 1, **body, **extra}, param)


def test_a_key_twice_is_refused(daemon) -> None:
    raw = b'{"model": "nope", "model": "tiny", "prompt": "x", "max_tokens": 1}'
    code, resp = daemon.post("/v1/completions", raw=raw)
    assert code == 400 and resp["error"]["code"] == "invalid_json" and "'model'" in resp["error"]["message"], resp
    nested = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
    nested = nested.replace('"content": "x"', '"content": "x", "content": "y"').encode()
    code, resp = daemon.post("/v1/chat/completions", raw=nested)
    assert code == 400 and resp["error"]["code"] == "invalid_json", resp
    code, _ = daemon.post("/v1/completions", raw=b'{"model": "tiny", "prompt": "x", "max_tokens": 1}')
    assert code == 200
