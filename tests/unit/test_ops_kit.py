"""Alert rules, dashboard and installer: they parse, use only metrics the agent exports, cover
what operators are promised, and the installer lays out a root correctly and idempotently; ops/README.md
names every bench and device script, and every script a wrapper runs exists."""

from __future__ import annotations

import json
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from agent.metrics import MODEL_STATES, Metrics

REPO = Path(__file__).resolve().parents[2]
METRIC_RE = re.compile(r"\b(infire_[a-z0-9_]+)")


def exported_series() -> set[str]:
    """Every sample name the agent's registry can emit (counters as *_total, histograms split)."""
    names: set[str] = set()
    for fam in Metrics().registry.collect():
        if fam.type == "counter":
            names |= {fam.name + "_total", fam.name + "_created"}
        elif fam.type == "histogram":
            names |= {fam.name + s for s in ("_bucket", "_sum", "_count", "_created")}
        else:
            names.add(fam.name)
    return names


def documented_series() -> set[str]:
    text = (REPO / "docs" / "architecture.md").read_text().split("## Metrics", 1)[1]
    return set(re.findall(r"`(infire_[a-z0-9_]+)`", text))


def test_documented_metrics_are_exported() -> None:
    exported = exported_series()
    for name in documented_series():
        assert name in exported or name + "_total" in exported or name + "_bucket" in exported, name


@pytest.fixture(scope="module")
def rules() -> list[dict]:
    doc = yaml.safe_load((REPO / "ops" / "prometheus" / "alerts.yml").read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def test_alert_rules_are_well_formed(rules: list[dict]) -> None:
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for r in rules:
        assert set(r) <= {"alert", "expr", "for", "labels", "annotations"}, r["alert"]
        assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
        assert "for" not in r or re.fullmatch(r"\d+[smh]", r["for"]), r["alert"]
        assert r["expr"].count("(") == r["expr"].count(")"), r["alert"]


def test_alert_rules_use_exported_metrics_and_cover_the_promises(rules: list[dict]) -> None:
    exported = exported_series()
    used: set[str] = set()
    for r in rules:
        for m in METRIC_RE.findall(r["expr"]):
            assert m in exported, f"{r['alert']}: {m} is not exported by agent/metrics.py"
            used.add(m)
    promised = {  # issue 8: restarts, readiness, queue saturation, KV pressure, cache quota, pulls
        "infire_worker_restarts_total", "infire_ready", "infire_queue_depth", "infire_kv_pages_used",
        "infire_cache_used_bytes", "infire_pull_failures_total",
    }
    assert promised <= used, sorted(promised - used)
    states = {s for r in rules for s in re.findall(r'state="([a-z]+)"', r["expr"])}
    assert states <= set(MODEL_STATES)


def test_dashboard_covers_every_metric_with_exported_names() -> None:
    dash = json.loads((REPO / "ops" / "grafana" / "infire-agent.json").read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    exported = exported_series()
    used: set[str] = set()
    for p in dash["panels"]:
        for t in p.get("targets", []):
            for m in METRIC_RE.findall(t["expr"]):
                assert m in exported, f"panel {p['title']!r}: {m}"
                used.add(m.removesuffix("_bucket"))
            assert t["datasource"]["uid"] == "${datasource}"
    base = {m.removesuffix("_total") for m in documented_series()}
    missing = {m for m in base if m not in used and m + "_total" not in used}
    assert not missing, sorted(missing)
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource", "instance", "model"}


def _install(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(REPO / "ops" / "install.sh"), "--root", str(root), "--skip-venv", *args],
                          capture_output=True, text=True, timeout=60)


def test_install_into_a_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    proc = _install(root, "--prefix", "/srv/infire")
    assert proc.returncode == 0, proc.stderr
    unit = (root / "etc/systemd/system/infire-agent.service").read_text()
    assert "ExecStart=/srv/infire/venv/bin/infire-agent serve" in unit and "/opt/infire-agent" not in unit
    assert (root / "usr/lib/sysusers.d/infire-agent.conf").exists()
    assert (root / "srv/infire/docs/operations.md").exists()
    env = root / "etc/infire/agent.env"
    assert stat.S_IMODE(env.stat().st_mode) == 0o600
    token = re.search(r"^INFIRE_ADMIN_TOKEN=([0-9a-f]+)$", env.read_text(), re.M)
    assert token and len(token.group(1)) == 64
    if shutil.which("systemd-sysusers"):
        assert re.search(r"^infire:", (root / "etc/passwd").read_text(), re.M)
    # Re-running upgrades files but keeps the operator's environment file and token.
    env.write_text(env.read_text() + "INFIRE_LOG_LEVEL=debug\n")
    proc = _install(root, "--prefix", "/srv/infire")
    assert proc.returncode == 0, proc.stderr
    assert token.group(0) in env.read_text() and "INFIRE_LOG_LEVEL=debug" in env.read_text()


@pytest.mark.parametrize("args, message", [(("--prefix", "relative/dir"), "must be absolute"), (("--bogus",), "unknown argument")])
def test_install_refuses_bad_arguments(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    proc = _install(tmp_path / "root", *args)
    assert proc.returncode != 0 and message in proc.stderr
    assert not (tmp_path / "root" / "etc").exists()


def test_ops_readme_names_every_script_and_wrappers_run_only_present_ones() -> None:
    readme = (REPO / "ops" / "README.md").read_text()
    scripts = [p for p in (REPO / "ops" / "gpu").iterdir() if p.suffix in (".py", ".sh")]
    scripts += [p for p in (REPO / "ops" / "bench").glob("*.py") if p.name != "__init__.py"]
    named = {p.name for p in scripts if f"`{p.name}" in readme or f"`{p.stem}`" in readme}
    assert {p.name for p in scripts} - named == set()
    for wrapper in (REPO / "ops" / "gpu").glob("*.sh"):
        for used in re.findall(r"ops/gpu/([A-Za-z0-9_]+\.(?:py|sh))", wrapper.read_text()):
            assert (REPO / "ops" / "gpu" / used).exists(), f"{wrapper.name} runs a missing ops/gpu/{used}"
