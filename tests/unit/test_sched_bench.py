"""ops.bench.sched_bench measures real schedule/update calls of N running decodes."""

from ops.bench.sched_bench import run


def test_sched_bench_times_every_running_decode():
    r = run(running=16, steps=5, prompt_len=20)
    assert r["running"] == 16 and r["steps"] == 5
    assert r["schedule_ms"] > 0 and r["update_ms"] > 0
