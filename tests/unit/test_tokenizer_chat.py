"""text.tokenizer chat templates: parity with transformers, hostile templates, bounds."""

from __future__ import annotations

import json
import time

import pytest

from text.chat_template import ChatTemplate, ChatTemplateError, ChatTemplateLimits
from text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_llama_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_llama_dir)


@pytest.fixture(scope="module")
def hf_tok(tiny_llama_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)


# -- chat templates -----------------------------------------------------------------------

_CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "Où est la gare? 日本 😀"},
        {"role": "assistant", "content": "À droite."},
        {"role": "user", "content": "Merci\n"},
    ],
    [{"role": "user", "content": [{"type": "text", "text": "part one, "},
                                  {"type": "text", "text": "part two"}]}],
    [{"role": "user", "content": "call it"}, {"role": "assistant", "content": None}],
]


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("messages", _CONVERSATIONS)
def test_chat_template_matches_transformers(tok, hf_tok, messages, gen):
    ours = tok.apply_chat_template(messages, add_generation_prompt=gen)
    theirs = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert ours == theirs
    assert tok.encode(ours, add_special_tokens=False) == hf_tok.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=gen, return_dict=False
    )


# Uses what real templates (Llama 3.1, Qwen) use: namespace, slicing, loop controls,
# tojson with indent, tests, filters, raise_exception, attribute-style access, tools.
_RICH_TEMPLATE = """{{- bos_token }}
{%- set ns = namespace(system='', count=0) %}
{%- if messages[0].role == 'system' %}
    {%- set ns.system = messages[0].content | trim %}
    {%- set rest = messages[1:] %}
{%- else %}
    {%- set rest = messages %}
{%- endif %}
{%- if tools is defined and tools %}
    {%- set ns.system = ns.system ~ '\n\nTools:\n' %}
    {%- for t in tools %}
        {%- set ns.system = ns.system ~ (t | tojson(indent=4)) ~ '\n' %}
    {%- endfor %}
{%- endif %}
{%- if ns.system %}<|start_header_id|>system<|end_header_id|>\n\n{{ ns.system }}<|eot_id|>{% endif %}
{%- for message in rest %}
    {%- if message.role not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception('unknown role ' ~ message.role) }}
    {%- endif %}
    {%- if message.role == 'tool' and loop.first %}{% break %}{% endif %}
    {%- set ns.count = ns.count + 1 %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
    {%- if message.tool_calls is defined %}
        {%- for call in message.tool_calls %}
            {{- call.function | dictsort | tojson }}{% if not loop.last %}, {% endif %}
        {%- endfor %}
    {%- else %}
        {{- message.content | trim }}
    {%- endif %}
    {{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}
{{- '' if ns.count else '(empty)' }}"""

_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Wetter <&> 天気",
                                            "parameters": {"type": "object", "properties": {}}}}]


@pytest.mark.parametrize("tools", [None, _TOOLS])
def test_rich_template_matches_transformers(tok, hf_tok, tools):
    messages = [
        {"role": "system", "content": " Answer briefly. "},
        {"role": "user", "content": "Weather in Köln? 🌧"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Köln"}}}
        ]},
        {"role": "user", "content": "Thanks"},
    ]
    ours = ChatTemplate(_RICH_TEMPLATE).render(
        messages, add_generation_prompt=True, tools=tools, bos_token="<|begin_of_text|>")
    theirs = hf_tok.apply_chat_template(messages, tools=tools, chat_template=_RICH_TEMPLATE,
                                        tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert ("Tools:" in ours) == bool(tools)
    with pytest.raises(ChatTemplateError, match="unknown role robot"):
        ChatTemplate(_RICH_TEMPLATE).render([{"role": "robot", "content": "x"}])


def test_chat_template_prefers_jinja_file_and_named_templates(tmp_path, tiny_llama_dir):
    for name in ("tokenizer.json", "generation_config.json"):
        (tmp_path / name).write_bytes((tiny_llama_dir / name).read_bytes())
    config = json.loads((tiny_llama_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "T"},
                               {"name": "default", "template": "{{ messages|length }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_dir(tmp_path).apply_chat_template([{"role": "u", "content": ""}]) == "1"
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}{{ tools|tojson }}")
    out = Tokenizer.from_dir(tmp_path).apply_chat_template(_CONVERSATIONS[0], tools=[{"n": "<é>"}])
    assert out == '<|begin_of_text|>[{"n": "<é>"}]'


_LIMITS = ChatTemplateLimits(max_output_chars=100_000, max_steps=200_000, timeout_s=0.5)

_HOSTILE = [
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{{ f(n - 1) }}{{ f(n - 1) }}{% endmacro %}{{ f(60) }}",
    "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
    "{{ f(40) }}",
    "{% set s = 'x' %}" + "{% set s = s ~ s %}" * 40 + "{{ s }}",
    "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}",
    "{% set s %}abcd{% endset %}" + "{% set s %}{{ s }}{{ s }}{% endset %}" * 40,
    "{% set ns = namespace(l=[1]) %}{% for i in range(60) %}{% set ns.l = ns.l + ns.l %}"
    "{% endfor %}",
    "{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('x') }}",
    "{{ 'x' * 10**10 }}",
    "{{ [1] * 10**10 }}",
    "{{ 7 ** (10**8) }}",
    "{{ '%0999999999d' % 1 }}",
    "{{ '%.*f' % (999999999, 1) }}",
    "{{ '{:>999999999}'.format(1) }}",
    "{{ 'x'.ljust(10**9) }}",
    "{{ 'x'|center(10**9) }}",
    "{{ ('\t' * 1000)|string|attr('expandtabs')(99999) }}",
    "{{ ('\t' * 1000).expandtabs(99999) }}",
    "{{ ('a' * 100000)|replace('a', 'aaaaaaaaaa') }}",
    "{{ ('\n' * 10000)|indent(1000) }}",
    "{{ [1]|batch(10**9)|list }}",
    "{{ messages|tojson(indent=10**6) }}",
    "{% for i in range(10**9) %}{% endfor %}",
    "{% for i in range(90000) %}{{ 'yyyyyyyyyy' }}{% endfor %}",
    "{{ raise_exception('no system messages') }}",
    "{{ messages.append(1) }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}x{{ cycler.__init__.__globals__.os }}",
    "{% for %}",
]


# Each builds, from a 50k string, far more than the 100k output bound in one operation.
_AMPLIFIERS = [
    "{{ [s, s, s]|join }}",
    "{{ [s, s, s]|map('upper')|join }}",
    "{{ (range(5)|map('string')|list)|join(s) }}",
    "{{ ''.join([s, s, s]) }}",
    "{{ '{0}{0}{0}'.format(s) }}",
    "{{ '%s%s%s' % (s, s, s) }}",
    "{{ [s, s, s] }}",
    "{{ [s, s, s]|string }}",
    "{{ {'k': [s, s, s]}|pprint }}",
    "{{ [s, s, s]|tojson }}",
    "{{ [s, s, s]|sum(start='') }}",
    "{{ s ~ s ~ s }}",
    "{% set t %}{{ s }}{{ s }}{{ s }}{% endset %}",
    "{% macro m() %}{{ s }}{{ s }}{{ s }}{% endmacro %}{% set t = m() %}",
    "{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}"
    "{% endfor %}",
]


@pytest.mark.parametrize("source", _HOSTILE + ["{% set s = 'x' * 50000 %}" + a for a in _AMPLIFIERS])
def test_hostile_templates_are_bounded(source):
    start = time.monotonic()
    with pytest.raises(ChatTemplateError) as err:
        ChatTemplate(source, _LIMITS).render([{"role": "user", "content": "hi"}])
    assert "render time only" not in str(err.value)
    assert time.monotonic() - start < 5.0


_BENIGN = [
    "{{ range(10)|map('string')|join(',') }}|{{ ['a', 'b']|join }}|{{ 'é'|upper }}",
    "{{ '%s-%d' % ('a', 3) }}|{{ '{}/{}'.format(1, 2) }}|{{ [1, 2]|sum }}|{{ 'ab'|center(6) }}",
    "{% for i in range(3) %}{{ loop.index }}{% if loop.last %}!{% endif %}{% endfor %}",
    "{{ [1, 2, 3]|batch(2)|list }}|{{ messages|map(attribute='role')|join('/') }}",
    "{% for m in messages if m.role != 'system' %}{{ m.content|trim }};{% else %}none{% endfor %}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
    "{{ ns.n }}|{{ messages[-1]['content'][:3] }}|{{ 'a\tb'.expandtabs(2) }}",
    "{% macro f(x) %}<{{ x }}>{% endmacro %}{{ f('q') }}{{ 'x'.ljust(3, '-') }}{{ 'aXa'|replace('X', 'yy') }}",
    "{% for x in [[1, [2]], [3]] recursive %}{% if x is iterable %}{{ loop(x) }}{% else %}{{ x }}"
    "{% endif %}{% endfor %}|{{ 'a\nb'|indent(2, first=True) }}|{{ 'hello world'|truncate(8, True, '') }}",
]


@pytest.mark.parametrize("source", _BENIGN)
def test_bounds_do_not_change_what_templates_render(source):
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    messages = [{"role": "system", "content": " s "}, {"role": "user", "content": "hello"}]
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                          extensions=[loopcontrols])
    assert ChatTemplate(source).render(messages) == plain.from_string(source).render(
        messages=messages)


def test_time_bound_without_step_bound():
    limits = ChatTemplateLimits(max_steps=10**12, timeout_s=0.2)
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match="s$"):
        ChatTemplate(_HOSTILE[0], limits).render(_CONVERSATIONS[0])
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hello", "list"),
        ([], "at least one"),
        ([{"content": "no role"}], "role"),
        (["not a dict"], "role"),
        ([{"role": "user", "content": b"bytes"}], "unsupported"),
        ([{"role": "user", "content": object()}], "unsupported"),
        ([{"role": "user", "content": "x"}] * 5000, "too many"),
        ([{"role": "user", "content": "x" * (5 * 1024 * 1024)}], "too large"),
        ([{"role": "user", "content": [[[[[[[[[[[[[[[[[["deep"]]]]]]]]]]]]]]]]]]}], "deeper"),
        ([{"role": "user", "content": {1: "x"}}], "keys"),
    ],
)
def test_bad_messages_are_refused(tok, messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        tok.apply_chat_template(messages)


def test_template_and_output_size_bounds():
    limits = ChatTemplateLimits(max_template_chars=100, max_output_chars=1000)
    with pytest.raises(ChatTemplateError, match="characters"):
        ChatTemplate("x" * 101, limits)
    t = ChatTemplate("{% for m in messages %}{{ m.content * 3 }}{% endfor %}", limits)
    assert t.render([{"role": "u", "content": "ab"}]) == "ababab"
    with pytest.raises(ChatTemplateError):
        t.render([{"role": "u", "content": "y" * 400}])


def test_model_without_or_with_broken_template(tmp_path, tiny_llama_dir):
    (tmp_path / "tokenizer.json").write_bytes((tiny_llama_dir / "tokenizer.json").read_bytes())
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_ids == () and tok.bos_token_id is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
    tok = Tokenizer.from_dir(tmp_path)  # loads; only chat fails
    assert tok.decode(tok.encode("ok", add_special_tokens=False)) == "ok"
    with pytest.raises(ChatTemplateError, match="invalid"):
        tok.apply_chat_template([])
