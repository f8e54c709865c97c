"""deploy/kubernetes validates offline for the Kubernetes version docs/fleet.md names (strict:
an unknown or misspelt field fails), and agrees with the daemon it deploys: its config loads,
ports, probes, labels and drain times line up, and the endpoint picker reads the gauges the
agent exposes.

Built-in kinds are checked against Kubernetes' own schemas (kubernetes-validate, strict). The
Gateway API kinds (InferencePool, HTTPRoute) are CRDs: they are checked against schemas written
here from their v1 API references, for the fields these manifests use; the cluster's CRDs stay
the authority (docs/fleet.md)."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from agent import gateway_metrics as gm

kv = pytest.importorskip("kubernetes_validate")

K8S_VERSION = "1.33.0"  # docs/fleet.md names it
DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"

_NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", "maxLength": 253}
_PORT = {"type": "object", "additionalProperties": False, "required": ["number"],
         "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}}}
_META = {"type": "object", "required": ["name"], "properties": {"name": _NAME, "namespace": _NAME}}
CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("inference.networking.k8s.io/v1", "InferencePool"): {
        "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "inference.networking.k8s.io/v1"}, "kind": {"const": "InferencePool"},
            "metadata": _META,
            "spec": {"type": "object", "additionalProperties": False,
                     "required": ["selector", "targetPorts", "endpointPickerRef"],
                     "properties": {
                         "selector": {"type": "object", "additionalProperties": False, "required": ["matchLabels"],
                                      "properties": {"matchLabels": {"type": "object", "minProperties": 1,
                                                                     "additionalProperties": {"type": "string"}}}},
                         "targetPorts": {"type": "array", "minItems": 1, "maxItems": 8, "items": _PORT},
                         "endpointPickerRef": {
                             "type": "object", "additionalProperties": False, "required": ["name", "port"],
                             "properties": {"group": {"type": "string"}, "kind": {"type": "string"}, "name": _NAME,
                                            "port": _PORT, "failureMode": {"enum": ["FailOpen", "FailClose"]}}}}}}},
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): {
        "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "gateway.networking.k8s.io/v1"}, "kind": {"const": "HTTPRoute"},
            "metadata": _META,
            "spec": {"type": "object", "additionalProperties": False, "required": ["parentRefs", "rules"],
                     "properties": {
                         "parentRefs": {"type": "array", "minItems": 1, "items": {
                             "type": "object", "additionalProperties": False, "required": ["name"],
                             "properties": {"group": {"type": "string"}, "kind": {"type": "string"}, "name": _NAME,
                                            "namespace": _NAME, "sectionName": {"type": "string"}}}},
                         "rules": {"type": "array", "minItems": 1, "items": {
                             "type": "object", "additionalProperties": False,
                             "properties": {
                                 "matches": {"type": "array", "items": {
                                     "type": "object", "additionalProperties": False,
                                     "properties": {"path": {
                                         "type": "object", "additionalProperties": False, "required": ["type", "value"],
                                         "properties": {"type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                                                        "value": {"type": "string", "pattern": "^/"}}}}}},
                                 "backendRefs": {"type": "array", "minItems": 1, "items": {
                                     "type": "object", "additionalProperties": False, "required": ["name"],
                                     "properties": {"group": {"type": "string"}, "kind": {"type": "string"},
                                                    "name": _NAME, "namespace": _NAME,
                                                    "weight": {"type": "integer", "minimum": 0}}}},
                                 "timeouts": {"type": "object", "additionalProperties": False,
                                              "properties": {"request": {"type": "string", "pattern": r"^\d+(s|ms|m|h)$"},
                                                             "backendRequest": {"type": "string"}}}}}}}}}},
}


def _docs() -> list[dict[str, Any]]:
    out = []
    for p in sorted(DEPLOY.glob("*.yaml")):
        out += [d for d in yaml.safe_load_all(p.read_text()) if d is not None]
    return out


def _one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in _docs() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def _validate(doc: dict[str, Any]) -> None:
    schema = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
    if schema is not None:
        jsonschema.validate(doc, schema)
    else:
        kv.validate(doc, K8S_VERSION, strict=True)


def test_every_manifest_validates_strictly_for_the_named_version():
    docs = _docs()
    assert {d["kind"] for d in docs} >= {"ConfigMap", "Secret", "DaemonSet", "Service", "InferencePool", "HTTPRoute",
                                         "Deployment", "ServiceAccount", "Role", "RoleBinding"}
    for d in docs:
        _validate(d)
    assert K8S_VERSION.rsplit(".", 1)[0] in (Path(__file__).resolve().parents[2] / "docs" / "fleet.md").read_text()


@pytest.mark.parametrize("kind, path, field", [
    ("DaemonSet", ["spec", "template", "spec", "containers", 0], "livenesProbe"),
    ("DaemonSet", ["spec", "template", "spec"], "terminationGracePeriod"),
    ("InferencePool", ["spec"], "targetPortNumber"),
    ("HTTPRoute", ["spec", "rules", 0, "backendRefs", 0], "prot"),
])
def test_a_misspelt_field_fails_validation(kind, path, field):
    doc = copy.deepcopy(_one(kind))
    node = doc
    for k in path:
        node = node[k]
    node[field] = 1
    with pytest.raises((jsonschema.ValidationError, kv.ValidationError)):
        _validate(doc)


def test_the_manifests_agree_with_the_daemon_they_deploy(tmp_path, monkeypatch):
    from agent.config import load_settings
    from agent.http.health import Health

    for k in [k for k in __import__("os").environ if k.startswith("INFIRE_")]:
        monkeypatch.delenv(k)
    toml = tmp_path / "agent.toml"
    toml.write_text(_one("ConfigMap")["data"]["agent.toml"])
    settings = load_settings(toml)
    assert settings.server.host == "0.0.0.0" and [m.name for m in settings.models]

    ds = _one("DaemonSet")
    pod = ds["spec"]["template"]
    agent = pod["spec"]["containers"][0]
    assert agent["ports"][0]["containerPort"] == settings.server.port
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(settings.server.port)
    probes = {agent[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe", "readinessProbe")}
    routes = {r.path for r in Health(ctx=None).routes()}  # type: ignore[arg-type]
    assert probes == {"/livez", "/readyz"} and probes <= routes
    mounts = {m["mountPath"] for m in agent["volumeMounts"]}
    assert {str(settings.cache.dir), str(settings.server.runtime_dir), "/etc/infire-agent"} <= mounts
    assert agent["args"][-1] == "/etc/infire-agent/agent.toml"
    pause = agent["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["spec"]["terminationGracePeriodSeconds"] > settings.server.drain_timeout + pause
    assert set(_one("Secret")["stringData"]) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "INFIRE_SERVER__ADMIN_TOKEN"}
    assert agent["envFrom"][0]["secretRef"]["name"] == _one("Secret")["metadata"]["name"]

    pool = _one("InferencePool")["spec"]
    assert pool["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert [p["number"] for p in pool["targetPorts"]] == [settings.server.port]
    epp = _one("Deployment", pool["endpointPickerRef"]["name"])["spec"]["template"]["spec"]["containers"][0]
    flags = dict(re.fullmatch(r"--([a-z-]+)=(.*)", a).groups() for a in epp["args"])
    assert flags["total-queued-requests-metric"] == gm.WAITING
    assert flags["total-running-requests-metric"] == gm.RUNNING
    assert flags["kv-cache-usage-percentage-metric"] == gm.KV_USAGE
    assert flags["cache-info-metric"] == gm.CACHE_INFO
    assert flags["lora-info-metric"] == "" and flags["pool-name"] == _one("InferencePool")["metadata"]["name"]
    assert int(flags["grpc-port"]) == pool["endpointPickerRef"]["port"]["number"]
