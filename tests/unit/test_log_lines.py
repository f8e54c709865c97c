"""A log line reaches stderr as one write, newline included, so nothing another process writes to
the same file (the worker, Triton's nanobind report at exit) can glue itself to it; the worker
and the CLI end without the interpreter teardown where that report is printed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_each_log_line_is_one_write_with_its_newline(tmp_path: Path) -> None:
    code = (
        "import os, sys\n"
        "writes = []\n"
        "real = os.write\n"
        "os.write = lambda fd, b: writes.append(bytes(b)) or real(fd, b)\n"
        "from agent.log import configure_logging, get_logger\n"
        "configure_logging('json', 'info')\n"
        "get_logger('t').info('stopped', big='x' * 20000)\n"
        "get_logger('t').info('last')\n"
        "os.write = real\n"
        "assert len(writes) == 2 and all(w.endswith(b'\\n') and w.count(b'\\n') == 1 for w in writes), writes\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 2 and lines[-1].endswith("}"), lines[-1][-80:]


def test_the_cli_skips_teardown_reports_after_a_triton_command(tmp_path: Path) -> None:
    """A teardown hook stands in for nanobind's leak report: it never runs, the output is whole."""
    code = (
        "import atexit, sys, types\n"
        "sys.modules['triton'] = types.ModuleType('triton')\n"
        "atexit.register(lambda: sys.stderr.write('nanobind: leaked 5 instances!'))\n"
        "from agent.cli import main\n"
        "sys.argv = ['infire-agent', 'make-model', '--arch', 'llama', '--preset', 'tiny', '--out', sys.argv[1], "
        "'--device', 'cpu']\n"
        "sys.exit(main())\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m")], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "leaked" not in r.stderr and r.stdout.endswith("\n") and (tmp_path / "m" / "config.json").is_file()
