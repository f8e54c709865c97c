"""Fixtures of the reliability suite: one real daemon per module and a tally of the figures.

The tally is written as JSON to ``$RELIABILITY_FIGURES`` (when set) at the end of the session;
docs/reliability.md records a run of it.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator

import pytest

from tests.integration.agent_harness import Daemon, publish_tiny
from tests.reliability.rel_helpers import CTX, MODEL


@pytest.fixture(scope="session")
def tally() -> Iterator[Counter[str]]:
    counts: Counter[str] = Counter()
    yield counts
    out = os.environ.get("RELIABILITY_FIGURES")
    if out:
        with open(out, "w") as f:
            json.dump(dict(counts), f, indent=1, sort_keys=True)


@pytest.fixture(scope="module")
def daemon(make_tiny_model, tmp_path_factory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("rel-agent")
    url = publish_tiny(make_tiny_model, tmp / "store", MODEL)
    d = Daemon(tmp, store_url=url,
               models=[{"name": MODEL, "preload": True, "max_model_len": CTX, "max_num_seqs": 4}])
    d.start(timeout=120)
    yield d
    d.stop()
