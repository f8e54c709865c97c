"""``python -m engine.worker``: the engine worker process (engine/worker/main.py)."""

import sys

from engine.worker.main import main

sys.exit(main())
