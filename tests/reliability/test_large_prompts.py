"""Large prompts never stall the server: four concurrent 4 MB prompts (under the body limit) are
refused before they are tokenized, while /livez and a one-token completion keep answering, and the
agent's memory goes back to where it was.

The issue's targets are /livez < 100 ms and a completion < 1 s; the assertions here are looser
(a loaded 2-core CI box), and docs/reliability.md records the measured figures."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

from tests.reliability.rel_helpers import MODEL, healthy, rss_bytes

BIG = "b c " * 999999  # 4 MB of text: ~2 M tokens, far over the 256-token context


def _post(base: str, body: dict | bytes, timeout: float = 120.0) -> tuple[int, dict, float]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(base, data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), time.monotonic() - t0
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), time.monotonic() - t0


def test_four_4mb_prompts_do_not_stall_the_server(daemon, tally) -> None:
    pid = daemon.proc.pid
    healthy(daemon)
    base_rss = rss_bytes(pid)
    stop = threading.Event()
    livez: list[float] = []
    peak = [base_rss]

    def probe() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                code, _ = daemon.get("/livez", timeout=30)
            except OSError:  # a timeout: as slow as it gets
                code = 0
            livez.append(time.monotonic() - t0 if code == 200 else float("inf"))
            peak[0] = max(peak[0], rss_bytes(pid))
            time.sleep(0.01)

    answers: list[tuple[int, dict, float]] = []
    big = [{"model": MODEL, "prompt": BIG, "max_tokens": 1},
           {"model": MODEL, "prompt": BIG, "max_tokens": 1},
           {"model": MODEL, "prompt": BIG, "max_tokens": 1},
           {"model": MODEL, "max_tokens": 1,
            "messages": [{"role": "user", "content": "b c " * 249999} for _ in range(4)]}]
    # Encoded up front: this process's own GIL must not delay the probe it times.
    bodies = [(daemon.base + ("/v1/chat/completions" if "messages" in b else "/v1/completions"),
               json.dumps(b).encode()) for b in big]
    prober = threading.Thread(target=probe)
    senders = [threading.Thread(target=lambda u=u, b=b: answers.append(_post(u, b))) for u, b in bodies]
    prober.start()
    for t in senders:
        t.start()
    time.sleep(0.05)
    small = _post(daemon.base + "/v1/completions", {"model": MODEL, "prompt": "ok", "max_tokens": 1})
    for t in senders:
        t.join(120)
    stop.set()
    prober.join()  # its last probe included: a probe stuck until now counts

    assert len(answers) == 4
    for code, body, _ in answers:
        assert code == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert small[0] == 200, small
    time.sleep(0.5)
    after = rss_bytes(pid)
    figures = {"livez_max_ms": round(max(livez) * 1000), "livez_n": len(livez),
               "completion_ms": round(small[2] * 1000),
               "refusal_max_ms": round(max(a[2] for a in answers) * 1000),
               "rss_base_mib": base_rss >> 20, "rss_peak_mib": peak[0] >> 20, "rss_after_mib": after >> 20}
    print("large prompts:", figures)
    for k, v in figures.items():
        tally[f"large_prompts_{k}"] = v
    # Generous on a loaded box (the issue saw 10.8 s and 24 s before); the doc has the real figures.
    assert max(livez) < 1.0 and small[2] < 5.0, figures
    assert after - base_rss < 50 << 20, figures
    healthy(daemon)
    tally["requests"] += 5 + len(livez)
    tally["bad_inputs"] += 4
