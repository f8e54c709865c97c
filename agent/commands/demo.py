"""``infire-agent demo``: the embedded default, end to end on one machine.

1. Seeds a local file store (under the user's data dir) with a small generated model
   (``make-model`` + ``publish``), once; later runs reuse it.
2. Starts the daemon on loopback in the background (or reuses one already running), with that
   store, a cache next to it and the model preloaded; its log goes to a file. Its admin socket
   is at the default place (``server.runtime_dir``), where ``infire-agent status``, ``load``,
   ``publish`` and ``stop`` look with no setting.
3. Streams one chat answer through the OpenAI API and prints it as it arrives.
4. Leaves the daemon running and prints the commands to try next.

The model has random weights, so the answer is noise: the point is the path a request takes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from agent.http import sse

DEFAULT_MODEL = "demo-llama"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="seed a local store with a small model, start the daemon, stream one answer",
                       description='Try the daemon end to end on this machine: make a small random-weight model and publish it into a local store (once), start the daemon on loopback in the background with that model preloaded, stream one chat answer, and print the commands to try next. The daemon keeps running; `infire-agent stop` stops it.')
    p.add_argument("--dir", help="demo folder (default: $XDG_DATA_HOME/infire/demo)")
    p.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3", "mistral"],
                   help="architecture of the generated model (default llama, served as demo-llama)")
    p.add_argument("--preset", default="small", choices=["tiny", "small"], help="size of the generated model (default small)")
    p.add_argument("--port", type=int, default=8080, help="preferred port (a free one is picked if taken)")
    p.add_argument("--prompt", default="Say hello to the edge.", help="the chat message of the one streamed answer")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens of that answer (default 48)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the model to be ready")
    p.set_defaults(func=run)


def _demo_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg).expanduser().resolve()
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "infire" / "demo"


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _pick_port(preferred: int) -> int:
    if _port_free(preferred):
        return preferred
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _say(msg: str) -> None:
    print(f"==> {msg}", flush=True)


def seed_store(root: Path, name: str, arch: str, preset: str) -> str:
    """Make and publish the model unless the store already has it; returns the store URL."""
    from cache.store import open_store
    from cache.publish import publish_model
    from cache.object_store import manifest_key

    store_dir = root / "store"
    store_dir.mkdir(parents=True, exist_ok=True)
    url = store_dir.as_uri()
    store = open_store(url)
    try:
        if store.exists(manifest_key(name)) is not None:
            _say(f"store {url} already has {name}")
            return url
        from modelgen.make import make_model

        model_dir = root / "models" / name
        if not (model_dir / "config.json").exists():
            _say(f"making a random-weight {arch} model (preset {preset}) in {model_dir}")
            make_model(model_dir, arch, preset, seed=0, device="cpu")
        _say(f"publishing {name} to {url}")
        publish_model(store, model_dir, name)
    finally:
        store.close()
    return url


def write_config(root: Path, store_url: str, name: str, port: int) -> Path:
    """The demo daemon's config. No runtime_dir: the admin socket goes where the CLI looks by
    default (``server.runtime_dir``'s one default), so ``infire-agent status`` finds it as is."""
    cfg = root / "agent.toml"
    cfg.write_text(
        "# written by `infire-agent demo`\n"
        f'[server]\nhost = "127.0.0.1"\nport = {port}\n\n'
        f'[store]\nurl = "{store_url}"\n\n'
        f'[cache]\ndir = "{root / "cache"}"\nmax_bytes = "10GiB"\n\n'
        f'[[models]]\nname = "{name}"\npreload = true\nmax_model_len = 2048\nmax_num_seqs = 32\n'
    )
    return cfg


def start_daemon(root: Path, cfg: Path) -> subprocess.Popen[bytes]:
    log = open(root / "agent.log", "ab")
    env = {**os.environ, "INFIRE_CONFIG": str(cfg)}
    # A new session: the daemon outlives this command and a Ctrl-C here does not reach it.
    return subprocess.Popen([sys.executable, "-m", "agent.cli", "serve", "--config", str(cfg)],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def waiting_for(st: dict | None, name: str) -> str | None:
    """What a starting daemon is busy with, in words, from its admin status (None: not up
    yet); "" when ``name`` is ready. Raises RuntimeError when the model failed."""
    if st is None:
        return "the daemon to start listening"
    w = st.get("worker") or {}
    m = next((m for m in st.get("models") or [] if m.get("name") == name), None)
    if m is not None and m.get("state") == "failed":
        raise RuntimeError(f"{name} failed: {m.get('reason')}")
    if not w.get("alive"):
        if w.get("last_exit"):
            return f"the engine worker to restart (it exited: {w['last_exit']})"
        return "the engine worker to start (it imports torch and checks the device)"
    state = (m or {}).get("state")
    if state == "ready":
        return ""
    if state == "pulling":
        pull = m.get("pull") or {}
        done = f" ({100 * pull['done_bytes'] / pull['total_bytes']:.0f}%)" if pull.get("total_bytes") else ""
        return f"{name} to be pulled into the cache{done}"
    if state == "loading":
        return f"{name} to load on the {w.get('device') or 'device'} (weights, KV pool, a first decode)"
    return f"{name} to start loading"


def wait_ready(cfg: Path, name: str, proc: subprocess.Popen[bytes] | None, timeout: float, log_path: Path) -> None:
    """Until ``name`` is ready on the agent of ``cfg``, saying what it waits for as that changes."""
    from agent.admin_client import AdminClient, AdminError, AgentDown
    from agent.config import load_settings

    client = AdminClient.from_settings(load_settings(cfg), timeout=5)
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else ""
            raise RuntimeError(f"the daemon exited with code {proc.returncode}; its log ends:\n{tail}")
        try:
            st = client.status()
        except (AgentDown, AdminError):
            st = None
        what = waiting_for(st, name)
        if what == "":
            return
        if what != last:
            _say(f"waiting for {what}")
            last = what
        time.sleep(0.25)
    raise TimeoutError(f"{name} was not ready after {timeout:.0f}s (see {log_path})")


def stream_chat(port: int, name: str, prompt: str, max_tokens: int) -> dict:
    """Stream one chat completion to stdout; returns the usage chunk."""
    import http.client

    body = {"model": name, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.8, "seed": 7}
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise RuntimeError(f"chat request failed: HTTP {r.status}: {r.read()[:500].decode(errors='replace')}")
    usage: dict = {}
    t0 = time.monotonic()
    first: float | None = None
    for line in r:
        chunk = sse.parse_line(line)
        if chunk is None:
            continue
        if chunk is sse.DONE:
            break
        if "error" in chunk:
            raise RuntimeError(f"stream error: {chunk['error']['message']}")
        if chunk.get("usage"):
            usage = chunk["usage"]
        for ch in chunk.get("choices", []):
            text = ch.get("delta", {}).get("content") or ""
            if text:
                first = first or time.monotonic()
                sys.stdout.write(text)
                sys.stdout.flush()
    c.close()
    usage["seconds"] = round(time.monotonic() - t0, 3)
    usage["ttft_s"] = round((first or time.monotonic()) - t0, 3)
    return usage


def _running_agent(cfg: Path) -> dict | None:
    """The status of an agent already answering on this config's admin socket, else None."""
    from agent.admin_client import AdminClient, AdminError, AgentDown
    from agent.config import load_settings

    try:
        return AdminClient.from_settings(load_settings(cfg), timeout=3).status()
    except (AgentDown, AdminError):
        return None


def _cli_finds(cfg: Path) -> bool:
    """Whether the CLI, run as is in this environment, talks to the agent of ``cfg``."""
    from agent.config import ConfigError, load_settings

    try:
        here = load_settings().server.admin_socket_path()
    except ConfigError:
        return False
    return here == load_settings(cfg).server.admin_socket_path()


def run(args: argparse.Namespace) -> int:
    from agent.config import ConfigError, load_settings
    from agent.log import configure_logging

    configure_logging("console", "warning")
    root = _demo_dir(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    name = DEFAULT_MODEL if args.arch == "llama" else f"demo-{args.arch}"
    try:
        store_url = seed_store(root, name, args.arch, args.preset)
        cfg = root / "agent.toml"
        if not cfg.exists():
            write_config(root, store_url, name, args.port)
        running = _running_agent(cfg)
        proc = None
        if running is not None:
            theirs = (running.get("store") or {}).get("url")
            if theirs != store_url:
                raise RuntimeError(
                    f"another agent (pid {running.get('pid')}, store {theirs}) is listening on "
                    f"{load_settings(cfg).server.admin_socket_path()}; stop it first (`infire-agent stop`), or run the "
                    "demo with INFIRE_SERVER__RUNTIME_DIR set to another folder")
            port = load_settings(cfg).server.port
            _say(f"an agent is already running on 127.0.0.1:{port} (pid {running.get('pid')}); reusing it")
            _load_via_admin(cfg, name)
        else:
            port = _pick_port(args.port)
            cfg = write_config(root, store_url, name, port)
            _say(f"starting the daemon on 127.0.0.1:{port} (log: {root / 'agent.log'})")
            proc = start_daemon(root, cfg)
        wait_ready(cfg, name, proc, args.timeout, root / "agent.log")
        _say(f"{name} is ready; streaming one chat answer (random weights: the text is noise)\n")
        usage = stream_chat(port, name, args.prompt, args.max_tokens)
    except (RuntimeError, TimeoutError, OSError, ConfigError) as e:
        print(f"\ndemo failed: {e}", file=sys.stderr)
        return 1
    print(f"\n\n==> {usage.get('completion_tokens', '?')} tokens in {usage['seconds']}s "
          f"(first token after {usage['ttft_s']}s)")
    base = f"http://127.0.0.1:{port}"
    cli = sys.argv[0] if Path(sys.argv[0]).name == "infire-agent" else f"{sys.executable} -m agent.cli"
    env = cli if _cli_finds(cfg) else f"INFIRE_CONFIG={cfg} {cli}"
    pid = proc.pid if proc else running.get("pid") if running else None
    print(f"""
The daemon keeps running (pid {pid}, config {cfg}). Try:

  {env} status
  curl -s {base}/v1/models
  curl -sN {base}/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{{"model": "{name}", "messages": [{{"role": "user", "content": "hi"}}], "stream": true}}'
  curl -s {base}/readyz ; curl -s {base}/metrics | grep infire_
  {env} unload {name} ; {env} load {name}
  tail -f {root / 'agent.log'}

Stop it with `{env} stop` (it drains, removes its socket and exits); `scripts/run.sh` starts it again.
""")
    return 0


def _load_via_admin(cfg: Path, name: str) -> None:
    from agent.admin_client import AdminClient
    from agent.config import load_settings

    status, body = AdminClient.from_settings(load_settings(cfg)).operate(name, "load", wait=False)
    if status >= 400:
        raise RuntimeError(f"load {name}: {(body.get('error') or {}).get('message', body)}")
