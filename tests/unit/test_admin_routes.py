"""The admin API's refusals of its own (no such route, wrong method) come in the JSON error shape,
and only after the token check: an unauthenticated client learns nothing of the routes."""

from __future__ import annotations

from types import SimpleNamespace

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from pydantic import SecretStr

from agent.http.admin_api import AdminApi

TOKEN = {"Authorization": "Bearer sesame"}


async def _client() -> TestClient:
    ctx = SimpleNamespace(settings=SimpleNamespace(server=SimpleNamespace(admin_token=SecretStr("sesame"))))
    admin = AdminApi(ctx, health=None)  # type: ignore[arg-type]
    app = web.Application(middlewares=[admin.middleware])
    app.add_routes(admin.routes())
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


async def test_unknown_admin_routes_and_methods_answer_json_after_auth() -> None:
    client = await _client()
    try:
        for method, path in (("GET", "/admin/v1/nope"), ("GET", "/admin"), ("GET", "/admin/v1/models/x/bogus"),
                             ("DELETE", "/admin/v1/status"), ("GET", "/admin/v1/models/tiny/load")):
            r = await client.request(method, path)  # no token: 401 first, whatever the route
            assert r.status == 401 and r.content_type == "application/json", (method, path, r.status)
            assert (await r.json())["error"]["code"] == "unauthorized"
        r = await client.get("/admin/v1/nope", headers=TOKEN)
        body = await r.json()
        assert r.status == 404 and body["error"]["code"] == "not_found" and "/admin/v1/nope" in body["error"]["message"]
        r = await client.delete("/admin/v1/status", headers=TOKEN)
        body = await r.json()
        assert r.status == 405 and body["error"]["code"] == "method_not_allowed" and "GET" in r.headers["Allow"]
        assert body["error"]["type"] == "invalid_request_error"
        r = await client.get("/admin/v1/models/tiny/load", headers=TOKEN)
        assert r.status == 405 and (await r.json())["error"]["code"] == "method_not_allowed"
    finally:
        await client.close()
