"""``python -m engine.worker``: the engine worker process (engine/worker/main.py).

On a normal return the process ends with ``os._exit`` once its output is flushed: interpreter
teardown has nothing left to do for it, and Triton's nanobind would print its "leaked instances"
report there (hundreds of lines on the agent's stderr, after the agent's last log line).
"""

import os
import sys

from engine.worker.main import main

code = main()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code if isinstance(code, int) else 1 if code else 0)
