"""engine_bench's comparison of two runs' greedy tokens (the figure issue 20's "identical outputs"
is reported with)."""
from ops.bench.engine_bench import compare_outputs


def test_identical_runs_agree_everywhere():
    a = {"r0": [1, 2, 3], "r1": [4]}
    assert compare_outputs(a, dict(a)) == {"requests": 2, "only_in_one": 0, "same_fraction": 1.0,
                                           "first_divergence_p50": None, "first_divergence_min": None}


def test_the_first_divergence_is_where_the_tokens_part():
    a = {"r0": [1, 2, 3, 4], "r1": [5, 6], "r2": [7, 8, 9], "r3": [1]}
    b = {"r0": [1, 2, 9, 9], "r1": [5, 6], "r2": [0, 8, 9], "r4": [1]}
    got = compare_outputs(a, b)
    assert got["requests"] == 3 and got["only_in_one"] == 2
    assert got["same_fraction"] == 1 / 3
    assert got["first_divergence_min"] == 0
    assert got["first_divergence_p50"] in (0, 2)


def test_a_shorter_run_parts_where_it_stops():
    got = compare_outputs({"r": [1, 2, 3]}, {"r": [1, 2]})
    assert got["same_fraction"] == 0.0 and got["first_divergence_min"] == 2
