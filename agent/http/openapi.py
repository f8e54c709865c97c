"""The OpenAPI 3.1 description of both HTTP APIs, served at ``GET /openapi.json``.

Request bodies come from the pydantic models in :mod:`agent.http.openai_schema` (so the spec cannot
drift from what the server validates); responses are described here, in the shapes the handlers
write. Built once per app; the document is immutable after that.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from pydantic.json_schema import models_json_schema

import agent
from agent.http.openai_schema import ChatCompletionRequest, CompletionRequest

_REF = "#/components/schemas/{model}"
_JSON = "application/json"


def _obj(props: dict[str, Any], required: list[str] | None = None, extra: bool = True) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required or list(props),
            "additionalProperties": extra}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _response_schemas() -> dict[str, Any]:
    s, i, n = {"type": "string"}, {"type": "integer"}, {"type": "number"}
    usage = _obj({"prompt_tokens": i, "completion_tokens": i, "total_tokens": i,
                  "prompt_tokens_details": _obj({"cached_tokens": i})})
    logprobs = _nullable({"type": "object"})
    finish = _nullable({"type": "string", "enum": ["stop", "length", "abort"]})
    text_choice = _obj({"index": i, "text": s, "logprobs": logprobs, "finish_reason": finish})
    chat_choice = _obj({"index": i, "message": _obj({"role": {"const": "assistant"}, "content": s}),
                        "logprobs": logprobs, "finish_reason": finish})
    envelope = {"id": s, "created": i, "model": s, "usage": usage}
    model_view = _obj({"name": s, "state": s, "in_flight": i, "queue_limit": i, "quantization": _nullable(s),
                       "kv_cache_dtype": _nullable(s),
                       "kv_pages": _obj({"used": i, "total": i})},
                      required=["name", "state", "in_flight"])
    return {
        "Error": _obj({"error": _obj({"message": s, "type": s, "param": _nullable(s), "code": _nullable(s)})}),
        "Completion": _obj({**envelope, "object": {"const": "text_completion"},
                            "choices": {"type": "array", "items": text_choice}}),
        "ChatCompletion": _obj({**envelope, "object": {"const": "chat.completion"},
                                "choices": {"type": "array", "items": chat_choice}}),
        "Model": _obj({"id": s, "object": {"const": "model"}, "created": i, "owned_by": s, "max_model_len": _nullable(i),
                       "state": {"enum": ["absent", "pulling", "cached", "loading", "ready", "draining",
                                          "unloading", "failed"]}}),
        "ModelList": _obj({"object": {"const": "list"}, "data": {"type": "array",
                                                                  "items": {"$ref": _REF.format(model="Model")}}}),
        "AdminModel": model_view,
        "AdminModelList": _obj({"models": {"type": "array", "items": {"$ref": _REF.format(model="AdminModel")}}}),
        "AdminModelOne": _obj({"model": {"$ref": _REF.format(model="AdminModel")}}),
        "AdminOperation": _obj({"model": {"$ref": _REF.format(model="AdminModel")},
                                "error": {"$ref": "#/components/schemas/Error/properties/error"},
                                "verify": _obj({"ok": {"type": "boolean"}, "repaired": {"type": "boolean"},
                                                "problems": {"type": "array", "items": s}})},
                               required=["model"]),
        "AdminStatus": _obj({"version": s, "pid": i, "uptime_s": n, "ready": {"type": "boolean"},
                             "draining": {"type": "boolean"}, "worker": {"type": "object"},
                             "budget": {"type": "object"}, "cache": {"type": "object"},
                             "models": {"type": "array", "items": {"$ref": _REF.format(model="AdminModel")}},
                             # exec to ready by phase, in seconds since the agent's exec; ready_s null until ready
                             "startup": _obj({"phases": {"type": "array", "items": _obj(
                                 {"name": s, "start_s": n, "seconds": n, "model": s, "parts": {"type": "object"}},
                                 required=["name", "start_s", "seconds"])},
                                 "ready_s": _nullable(n)})}),
        "Probe": {"type": "object"},
    }


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": _REF.format(model=name)}


def _answers(ok: dict[int, tuple[str, dict[str, Any]]], errors: tuple[int, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for code, (ctype, schema) in ok.items():
        out[str(code)] = {"description": "success" if code < 300 else "refused or failed",
                          "content": {ctype: {"schema": schema}}}
    for code in errors:
        out[str(code)] = {"description": "error", "content": {_JSON: {"schema": _ref("Error")}}}
    return out


def build_spec() -> dict[str, Any]:
    _, defs = models_json_schema([(CompletionRequest, "validation"), (ChatCompletionRequest, "validation")],
                                 ref_template=_REF)
    schemas = {**defs.get("$defs", {}), **_response_schemas()}
    bearer = [{"bearer": []}]
    name_param = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
    op_params = [name_param,
                 {"name": "wait", "in": "query", "required": False, "schema": {"type": "string",
                                                                             "enum": ["true", "false", "1", "0"]}},
                 {"name": "timeout", "in": "query", "required": False, "schema": {"type": "number", "minimum": 0,
                                                                                "maximum": 3600}}]
    sse = {"text/event-stream": {"schema": {"type": "string"}}}

    def generate(req: str, resp: str) -> dict[str, Any]:
        # 415: a Content-Encoding other than identity, gzip, deflate; 417: an Expect other than 100-continue.
        answers = _answers({200: (_JSON, _ref(resp))}, (400, 401, 404, 408, 413, 415, 417, 503))
        answers["200"]["content"].update(sse)
        return {"post": {"security": bearer, "requestBody": {"required": True, "content": {_JSON: {
            "schema": _ref(req)}}}, "responses": answers}}

    load_params = op_params + [{"name": key, "in": "query", "required": False,
                                "schema": {"type": "string", "enum": ["fp8", "none"]}}
                               for key in ("quantization", "kv_cache_dtype")]

    def admin_op(what: str) -> dict[str, Any]:
        return {"post": {"summary": f"{what} a model", "security": bearer,
                         "parameters": load_params if what == "load" else op_params,
                         "responses": _answers({200: (_JSON, _ref("AdminOperation")),
                                                202: (_JSON, _ref("AdminOperation")),
                                                500: (_JSON, _ref("AdminOperation"))},
                                               (400, 401, 404, 409, 503))}}

    probe = {"get": {"responses": _answers({200: (_JSON, _ref("Probe")), 503: (_JSON, _ref("Probe"))}, ())}}
    model_probe = _answers({200: (_JSON, _ref("Probe")), 404: (_JSON, _ref("Probe")), 503: (_JSON, _ref("Probe"))}, ())
    paths: dict[str, Any] = {
        "/v1/models": {"get": {"security": bearer, "responses": _answers({200: (_JSON, _ref("ModelList"))}, (401,))}},
        "/v1/models/{model}": {"get": {"summary": "one model of the list", "security": bearer,
                                       "parameters": [{**name_param, "name": "model"}],
                                       "responses": _answers({200: (_JSON, _ref("Model"))}, (401, 404))}},
        "/v1/completions": generate("CompletionRequest", "Completion"),
        "/v1/chat/completions": generate("ChatCompletionRequest", "ChatCompletion"),
        "/livez": probe, "/readyz": probe,
        "/readyz/{model}": {"get": {"parameters": [{**name_param, "name": "model"}], "responses": model_probe}},
        "/metrics": {"get": {"responses": {"200": {"description": "Prometheus text",
                                                   "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        "/openapi.json": {"get": {"responses": {"200": {"description": "this document",
                                                        "content": {_JSON: {"schema": {"type": "object"}}}}}}},
        "/admin/v1/status": {"get": {"security": bearer,
                                     "responses": _answers({200: (_JSON, _ref("AdminStatus"))}, (401,))}},
        "/admin/v1/models": {"get": {"security": bearer,
                                     "responses": _answers({200: (_JSON, _ref("AdminModelList"))}, (401,))}},
        "/admin/v1/models/{name}": {"get": {"security": bearer, "parameters": [name_param],
                                            "responses": _answers({200: (_JSON, _ref("AdminModelOne"))},
                                                                  (400, 401, 404))}},
        "/admin/v1/models/{name}/load": admin_op("load"),
        "/admin/v1/models/{name}/unload": admin_op("unload"),
        "/admin/v1/models/{name}/pull": admin_op("pull"),
        "/admin/v1/models/{name}/verify": {"post": {
            "summary": "check a cached model's files (sizes and every sha256) and repair them unless it is loaded",
            "security": bearer, "parameters": [name_param],
            "responses": _answers({200: (_JSON, _ref("AdminOperation")), 409: (_JSON, _ref("AdminOperation"))},
                                  (400, 401, 404, 503))}},
        "/admin/v1/models/{name}/drop-prefix-cache": {"post": {
            "summary": "forget a ready model's prefix cache (its free cached KV pages become plain free pages)",
            "security": bearer, "parameters": [name_param],
            "responses": _answers({200: (_JSON, _obj({"model": {"type": "string"}, "entries_dropped": {"type": "integer"}}))},
                                  (400, 401, 404, 409))}},
    }
    return {"openapi": "3.1.0",
            "info": {"title": "infire-agent", "version": agent.__version__,
                     "description": "OpenAI-compatible API (/v1) and admin API (/admin/v1) of the infire agent."},
            "paths": paths,
            "components": {"schemas": schemas,
                           "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}}


def routes() -> list[web.RouteDef]:
    body = json.dumps(build_spec(), separators=(",", ":")).encode()

    async def openapi_json(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type=_JSON)

    return [web.get("/openapi.json", openapi_json)]
