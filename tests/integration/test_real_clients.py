"""Client libraries users already run against OpenAI-compatible servers, driving a real daemon
(CPU, tiny random-weight llama, loopback) with their own calls (issue 36): LangChain's
``ChatOpenAI`` (a plain answer, a streamed one, structured output, a tool round trip with its own
message objects sent back) and ``OpenAI`` (``batch``: a list of prompts), LiteLLM's
``completion`` and ``text_completion``, and lm-evaluation-harness on two local tasks. Random weights write noise: only the grammar (structured
output, a forced tool call) makes the checked shape true, and the checks are of shapes, not text."""

from __future__ import annotations

import json
import os

import pytest

from tests.integration.agent_harness import Daemon, publish_tiny

pytest.importorskip("llguidance")
lc_openai = pytest.importorskip("langchain_openai")
lc_messages = pytest.importorskip("langchain_core.messages")
pydantic = pytest.importorskip("pydantic")
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm reads its price table from the wheel, not the net
litellm = pytest.importorskip("litellm")

MODEL = "tiny"


@pytest.fixture(scope="module")
def daemon(make_tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("real-clients")
    url = publish_tiny(make_tiny_model, tmp / "store", MODEL)
    d = Daemon(tmp, store_url=url,
               models=[{"name": MODEL, "preload": True, "max_model_len": 2048, "max_num_seqs": 8}])
    d.start(timeout=120)
    yield d
    d.stop()


def _chat(daemon: Daemon, **kw):
    return lc_openai.ChatOpenAI(model=MODEL, base_url=daemon.base + "/v1", api_key="unused", max_retries=0,
                                timeout=120, **kw)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    capital: bool
    climate: str = pydantic.Field(json_schema_extra={"enum": ["dry", "wet", "cold"]})


def test_langchain_chat_plain_and_streamed(daemon) -> None:
    llm = _chat(daemon, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True})
    msg = llm.invoke("hello")
    assert isinstance(msg, lc_messages.AIMessage) and isinstance(msg.content, str) and msg.content
    assert msg.response_metadata["finish_reason"] == "length"
    assert msg.usage_metadata["output_tokens"] == 6
    streamed = "".join(c.content for c in llm.stream("hello"))
    assert streamed == msg.content  # greedy: the same answer, chunk by chunk


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(daemon, method) -> None:
    """``with_structured_output``: by ``response_format`` (json_schema) or by a forced tool call
    (function_calling); either way LangChain parses the answer into the model class."""
    llm = _chat(daemon, max_tokens=200, temperature=1.0, seed=3).with_structured_output(City, method=method)
    city = llm.invoke("describe a city")
    assert isinstance(city, City) and len(city.name) <= 10 and city.climate in ("dry", "wet", "cold")


def test_langchain_tool_round_trip_with_its_own_messages(daemon) -> None:
    """A forced call, LangChain's AIMessage (with its tool_calls) and a ToolMessage sent back as
    history, and an answer in text once tools are off."""
    from langchain_core.tools import tool

    class Where(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=12)  # bounded: random weights never close a free string

    @tool(args_schema=Where)
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "18 C, sunny"

    llm = _chat(daemon, max_tokens=200, temperature=1.0, seed=5)
    ask = [lc_messages.HumanMessage("weather in Paris?")]
    ai = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(ask)
    assert ai.response_metadata["finish_reason"] == "tool_calls", (ai.response_metadata, ai.invalid_tool_calls)
    (call,) = ai.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str) and call["id"]
    history = ask + [ai, lc_messages.ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    talk = _chat(daemon, max_tokens=8, extra_body={"ignore_eos": True}).bind_tools([get_weather], tool_choice="none")
    final = talk.invoke(history)
    assert isinstance(final.content, str) and final.content and not final.tool_calls
    assert final.usage_metadata["input_tokens"] > talk.invoke(ask).usage_metadata["input_tokens"] + 10  # the call and its result went in


def test_langchain_completions_batch_is_one_request_per_prompt_list(daemon) -> None:
    llm = lc_openai.OpenAI(model=MODEL, base_url=daemon.base + "/v1", api_key="unused", max_retries=0, timeout=120,
                           max_tokens=4, temperature=0.0, model_kwargs={"extra_body": {"ignore_eos": True}})
    got = llm.batch(["a b c", "hello there", "x"])
    assert len(got) == 3 and all(isinstance(t, str) and t for t in got)
    assert got[0] == llm.invoke("a b c")  # greedy: a prompt's answer does not depend on its batch


def test_litellm_chat_text_and_stream(daemon) -> None:
    kw = dict(model=f"openai/{MODEL}", api_base=daemon.base + "/v1", api_key="unused", max_tokens=5,
              temperature=0.0, extra_body={"ignore_eos": True})
    msgs = [{"role": "user", "content": "hello"}]
    r = litellm.completion(messages=msgs, **kw)
    text = r.choices[0].message.content
    assert isinstance(text, str) and text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    chunks = list(litellm.completion(messages=msgs, stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    t = litellm.text_completion(prompt="a b c", **kw)
    assert isinstance(t.choices[0].text, str) and t.choices[0].text


def test_litellm_structured_output(daemon) -> None:
    r = litellm.completion(model=f"openai/{MODEL}", api_base=daemon.base + "/v1", api_key="unused",
                           messages=[{"role": "user", "content": "describe a city"}], max_tokens=200,
                           temperature=1.0, seed=4, response_format=City)
    City.model_validate(json.loads(r.choices[0].message.content))


def test_lm_eval_loglikelihood_and_generate_tasks(daemon, make_tiny_model, tmp_path) -> None:
    """lm-evaluation-harness's ``local-completions`` model on two local tasks: a multiple-choice
    task (loglikelihood: ``echo`` with prompt logprobs and ``max_tokens`` 0 over token-id prompts,
    two to a request) and a generate_until task. Each choice's loglikelihood is what the daemon
    itself gives that continuation; each generation is the daemon's greedy answer to the prompt."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    openai = pytest.importorskip("openai")
    transformers = pytest.importorskip("transformers")
    docs = [{"question": "one two", "choices": [" three", " four five"], "answer": 0},
            {"question": "red green", "choices": [" blue", " yellow", " black"], "answer": 2}]
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tmp_path / 'qa.jsonl'}\n"
              "test_split: test\ndoc_to_text: \"{{question}}\"\n")
    (tmp_path / "mc.yaml").write_text("task: tiny_mc\n" + common + "output_type: multiple_choice\n"
                                      "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
                                      "metric_list:\n  - metric: acc\n")
    (tmp_path / "gen.yaml").write_text("task: tiny_gen\n" + common + "output_type: generate_until\n"
                                       "doc_to_target: \"{{choices[answer]}}\"\ngeneration_kwargs:\n"
                                       "  until: [\"\\n\"]\n  max_gen_toks: 6\n  do_sample: false\n"
                                       "metric_list:\n  - metric: exact_match\n")
    model_dir = make_tiny_model("llama")
    out = lm_eval.simple_evaluate(
        model="local-completions", tasks=["tiny_mc", "tiny_gen"], task_manager=TaskManager(include_path=str(tmp_path)),
        model_args=f"model={MODEL},base_url={daemon.base}/v1/completions,tokenizer_backend=huggingface,"
                   f"tokenizer={model_dir},num_concurrent=1,max_retries=1,batch_size=2",
        log_samples=True, apply_chat_template=False)
    assert 0.0 <= out["results"]["tiny_mc"]["acc,none"] <= 1.0
    client = openai.OpenAI(base_url=daemon.base + "/v1", api_key="unused", max_retries=0, timeout=60)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    checked = 0
    for sample in out["samples"]["tiny_mc"]:
        for arg, ((ll, _), ) in zip(sample["arguments"], sample["resps"]):
            ctx, cont = (arg["arg_0"], arg["arg_1"]) if isinstance(arg, dict) else arg
            # lm-eval encodes the context and the continuation apart and sends the ids
            ids = [tok(x, add_special_tokens=False).input_ids for x in (ctx, cont)]
            r = client.completions.create(model=MODEL, prompt=ids[0] + ids[1], echo=True, logprobs=1, max_tokens=0)
            assert ll == pytest.approx(sum(r.choices[0].logprobs.token_logprobs[len(ids[0]):]), abs=1e-3), (ctx, cont)
            checked += 1
    assert checked == 5
    for sample in out["samples"]["tiny_gen"]:
        (arg,) = sample["arguments"]
        prompt = arg["arg_0"] if isinstance(arg, dict) else arg[0]
        want = client.completions.create(model=MODEL, prompt=tok(prompt, add_special_tokens=False).input_ids,
                                         max_tokens=6, temperature=0.0, stop=["\n"])
        assert sample["resps"][0][0] == want.choices[0].text
