"""A request the agent admitted whose model is unloaded before it reaches the engine (an unload's
drain that ended, a grammar compile the unload cut): the worker answers ``ModelNotLoaded``, which
the agent turns into 503 + Retry-After, never the 400 or the empty 500 ("CancelledError") a
churn pass saw for 32 of 72 such requests. A real worker loop over a socketpair, CPU engine."""

from __future__ import annotations

import time
from concurrent.futures import Future

from agent.http.api_error import stream_error
from agent.worker.client import WorkerError
from engine.sampling import SamplingParams
from engine.worker import protocol as P
from tests.integration.test_worker_idle import worker_loop

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_an_add_for_a_model_gone_or_cut_while_compiling_is_model_not_loaded(monkeypatch):
    with worker_loop() as (worker, core, agent):
        agent.send(P.Add(req_id="gone", model="m", prompt_token_ids=[5, 9], sampling=PARAMS))
        err = agent.wait_for(P.Error, req_id="gone")
        assert err.code == "ModelNotLoaded" and "not loaded" in err.message

        # A grammar compiling when the unload shut the model's grammar pool: its future is cancelled.
        pending: Future = Future()
        monkeypatch.setattr(core, "compile_grammar", lambda model, grammar: pending)
        agent.send(P.Add(req_id="cut", model="m", prompt_token_ids=[5, 9], sampling=PARAMS, grammar="start: /x/"))
        deadline = time.monotonic() + 30
        while worker._compile_futures.get("cut") is not pending:  # the Add is compiling
            assert time.monotonic() < deadline
            time.sleep(0.005)
        pending.cancel()
        err = agent.wait_for(P.Error, req_id="cut")
        assert err.code == "ModelNotLoaded" and "unloaded while the request's grammar compiled" in err.message

        api = stream_error(WorkerError(err.message, err.code))
        assert (api.status, api.code, api.param) == (503, "model_not_ready", "model") and api.retry_after >= 1
