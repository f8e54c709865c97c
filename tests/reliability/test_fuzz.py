"""Property fuzzing (hypothesis) of the parsers that take untrusted bytes: the manifest parser,
the safetensors header check, and chat message validation (request schema + template inputs).

Each target either accepts its input or raises its own typed error; nothing else escapes.
"""

from __future__ import annotations

import json
import struct

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from cache.errors import ManifestError, SafetensorsError
from cache.manifest import parse as parse_manifest
from cache.safetensors_check import DTYPE_BYTES, parse_header
from text.chat_template import ChatTemplate, ChatTemplateError, ChatTemplateLimits, check_inputs
from agent.http.openai_schema import ChatCompletionRequest, first_error

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DIGEST = "ab" * 32
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=20,
)
paths = st.one_of(
    st.sampled_from(["config.json", "model.safetensors", "a/b.json", "../x", "/abs", "a//b", "./a", "x.bin",
                     "A.json", "a.json", "a", "a/b", "nul\x00", "back\\slash", "ctl\x01", "x" * 300, ""]),
    st.text(max_size=40),
)
entries = st.fixed_dictionaries({
    "path": paths,
    "size": st.one_of(st.integers(-5, 2**45), st.just(True), st.floats(), st.text(max_size=3)),
    "sha256": st.one_of(st.just(DIGEST), st.text(max_size=70), st.just(DIGEST.upper()), st.integers()),
}) | json_values
manifests = st.fixed_dictionaries(
    {"version": st.one_of(st.just(1), json_values), "name": st.one_of(st.just("tiny"), st.text(max_size=20)),
     "files": st.one_of(st.lists(entries, max_size=6), json_values)},
    optional={"total_size": st.one_of(st.integers(-1, 2**46), json_values), "extra": json_values},
)


@FUZZ
@given(doc=manifests)
def test_manifest_parser_structured(doc) -> None:
    try:
        m = parse_manifest(json.dumps(doc).encode())
    except ManifestError as e:
        assert str(e)
        return
    # Accepted: every path is relative, clean and not a pickle; the round trip is stable.
    for f in m.files:
        assert not f.path.startswith("/") and ".." not in f.path.split("/") and not f.path.endswith(".bin")
    assert parse_manifest(m.to_json()) == m


@FUZZ
@given(data=st.binary(max_size=300))
def test_manifest_parser_raw_bytes(data) -> None:
    try:
        parse_manifest(data)
    except ManifestError:
        pass


tensors = st.fixed_dictionaries({
    "dtype": st.one_of(st.sampled_from(sorted(DTYPE_BYTES)), st.text(max_size=5), json_values),
    "shape": st.one_of(st.lists(st.integers(-2, 2**40), max_size=4), json_values),
    "data_offsets": st.one_of(st.lists(st.integers(-2, 2**40), min_size=2, max_size=2), json_values),
}) | json_values


@FUZZ
@given(doc=st.dictionaries(st.text(max_size=10), tensors, max_size=5), size=st.integers(0, 4096),
       meta=st.one_of(st.none(), json_values))
def test_safetensors_header_structured(doc, size, meta) -> None:
    if meta is not None:
        doc = {**doc, "__metadata__": meta}
    try:
        h = parse_header(json.dumps(doc).encode(), size)
    except SafetensorsError as e:
        assert str(e)
        return
    del h


@FUZZ
@given(header=st.binary(max_size=200), size=st.integers(-1, 1 << 20))
def test_safetensors_header_raw_bytes(header, size) -> None:
    try:
        parse_header(header, size)
    except SafetensorsError:
        pass


@FUZZ
@given(n=st.integers(0, 2**64 - 1), body=st.binary(max_size=64))
def test_safetensors_file_prefix(tmp_path_factory, n, body) -> None:
    from cache.safetensors_check import check_file

    p = tmp_path_factory.mktemp("st") / "x.safetensors"
    p.write_bytes(struct.pack("<Q", n) + body)
    try:
        check_file(p)
    except SafetensorsError:
        pass


messages = st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "root", ""]),
                           "content": st.one_of(st.text(max_size=30), st.none(), json_values)},
                          optional={"name": json_values}),
    json_values,
), max_size=5)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(msgs=st.one_of(messages, json_values), extra=st.dictionaries(st.text(max_size=6), json_values, max_size=3))
@example(msgs=[{"role": "user", "content": ";"}], extra={})  # content holding the separator
def test_chat_message_validation(msgs, extra) -> None:
    # The request schema: a clean 400 (param + message) or a valid request.
    try:
        req = ChatCompletionRequest.model_validate({"model": "tiny", "messages": msgs})
    except ValidationError as e:
        param, msg = first_error(e)
        assert param and msg
        req = None
    # The template's own input check, on the raw (unvalidated) shapes too.
    limits = ChatTemplateLimits(max_input_chars=2000, max_depth=6)
    try:
        copied, _ = check_inputs(msgs, extra, limits)
    except ChatTemplateError as e:
        assert str(e)
        copied = None
    if req is not None:
        plain = [{"role": m.role, "content": m.text()} for m in req.messages]
        # Content may itself hold the separator (';' was a falsifying example): compare the
        # whole rendering with what the template must produce, not a count of separators.
        out = ChatTemplate("{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}", limits).render(plain)
        assert out == "".join(f"{m['role']}:{m['content']};" for m in plain)
    del copied


def test_safetensors_unhashable_dtype_is_a_typed_error() -> None:
    """Found by the fuzzer above: a list or object dtype raised TypeError, not SafetensorsError."""
    for dtype in ([], {}, ["F32"], {"a": 1}):
        doc = {"t": {"dtype": dtype, "shape": [], "data_offsets": [0, 0]}}
        try:
            parse_header(json.dumps(doc).encode(), 0)
        except SafetensorsError as e:
            assert "unknown dtype" in str(e)
        else:
            raise AssertionError(f"dtype {dtype!r} was accepted")
