"""Starting a real ``argus`` service process in a test and finding the address it bound."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time


def start_argus(*args: str) -> subprocess.Popen[str]:
    """``python -m argus ARGS`` with stdout and stderr merged into a text pipe."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "argus", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def read_address(process: subprocess.Popen[str], name: str, timeout_s: float = 120) -> str:
    """The HOST:PORT of the process's ``argus NAME ... listening on HOST:PORT`` line."""
    assert process.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        found = re.search(r"listening on (\S+)", line)
        if found:
            return found.group(1)
    raise AssertionError(f"the {name} never printed its address")
