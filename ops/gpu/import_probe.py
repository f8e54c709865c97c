"""How long ``import torch`` takes in a fresh process, alone and beside the CUDA driver's context
creation (as the worker does it: engine/worker/setup.py), several times each, interleaved: is a
restart's varying ``worker_torch`` phase the import itself or the work beside it?

Run on the GPU machine: ``. ops/gpu/env.sh; python3 ops/gpu/import_probe.py OUT.json [ROUNDS]``.
Bytecode comes from a prefix cache (the worker's own arrangement; the first round writes it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

CHILD = r"""
import sys, threading, time
t0 = time.perf_counter()
if sys.argv[1] == "beside":
    from engine.worker.setup import open_cuda_context
    th = threading.Thread(target=open_cuda_context, args=("cuda",)); th.start()
import torch
t1 = time.perf_counter()
if sys.argv[1] == "beside":
    th.join()
t2 = time.perf_counter()
print(f"{t1 - t0:.4f} {t2 - t0:.4f}")
"""


def main() -> None:
    out, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 6
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = "/tmp/import-probe-pyc"
    rows = []
    subprocess.run([sys.executable, "-c", CHILD, "alone"], env=env, check=True, capture_output=True)  # bytecode
    for r in range(rounds):
        for mode in ("alone", "beside"):
            t = time.perf_counter()
            res = subprocess.run([sys.executable, "-c", CHILD, mode], env=env, capture_output=True, text=True)
            wall = time.perf_counter() - t
            imp, both = (float(x) for x in res.stdout.split()) if res.returncode == 0 else (-1.0, -1.0)
            rows.append({"round": r, "mode": mode, "import_s": imp, "with_context_s": both, "process_s": wall})
            print(rows[-1], flush=True)
    json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": os.environ.get("INFIRE_COMMIT"),
               "rows": rows}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
