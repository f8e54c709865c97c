"""The sharegpt-like workload: the exact recipe, bounds, determinism, vocab-independent lengths."""

from __future__ import annotations

import numpy as np
import pytest

from ops.bench.workload import sharegpt_like, summary


def test_recipe_bounds_and_means():
    reqs = sharegpt_like(1000, 128256, 0)
    assert len(reqs) == 1000
    for r in reqs:
        assert 4 <= r.input_len <= 1024 and r.output_len >= 4 and r.input_len + r.output_len <= 2048
        assert min(r.prompt_token_ids) >= 100 and max(r.prompt_token_ids) < 128256 - 100
    s = summary(reqs)
    assert s["mean_input"] == pytest.approx(215.713) and s["mean_output"] == pytest.approx(192.287)


def test_first_lengths_follow_the_recipe_by_hand():
    rng = np.random.default_rng(0)
    want = []
    while len(want) < 5:
        i, o = int(np.exp(rng.normal(5.05, 1.0))), int(np.exp(rng.normal(4.90, 0.9)))
        if 4 <= i <= 1024 and o >= 4 and i + o <= 2048:
            want.append((i, o))
    got = [(r.input_len, r.output_len) for r in sharegpt_like(5, 128256, 0)]
    assert got == want


def test_deterministic_and_lengths_do_not_depend_on_vocab():
    a, b = sharegpt_like(50, 512, 0), sharegpt_like(50, 512, 0)
    assert a == b
    big = sharegpt_like(50, 128256, 0)
    assert [(r.input_len, r.output_len) for r in a] == [(r.input_len, r.output_len) for r in big]
    assert sharegpt_like(50, 512, 1) != a


def test_bad_arguments():
    with pytest.raises(ValueError):
        sharegpt_like(10, 200, 0)
    with pytest.raises(ValueError):
        sharegpt_like(-1, 1000, 0)
