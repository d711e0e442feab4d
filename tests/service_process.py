"""Starting a real ``argus`` service process in a test and finding the address it bound; a
self-signed certificate for TLS tests."""

from __future__ import annotations

import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest


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


START_TIMEOUT_S = 600.0
"""How long a service process may take to print its address: generous, since imports alone
take tens of seconds on a loaded two-core machine; only a process that never gets ready
should reach it (one that exits fails at once)."""


def read_address(
    process: subprocess.Popen[str], name: str, timeout_s: float = START_TIMEOUT_S
) -> str:
    """The HOST:PORT of the process's ``argus NAME ... listening on HOST:PORT`` line.

    A thread reads the output and keeps draining it afterwards, so the wait is bounded even
    while the process prints nothing, and the process never blocks on a full pipe later.
    Fails, quoting the end of the output, when the process exits first or the bound passes.
    """
    stdout = process.stdout
    assert stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    printed: list[str] = []
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            why = f"printed no address within {timeout_s:.0f} s"
            break
        if line is None:
            why = f"exited (status {process.wait()}) without printing its address"
            break
        printed.append(line)
        found = re.search(r"listening on (\S+)", line)
        if found:
            return found.group(1)
    raise AssertionError(f"the {name} {why}; its output ends:\n" + "".join(printed[-20:]))


def self_signed_certificate(directory: Path) -> tuple[str, str]:
    """A self-signed certificate for localhost and 127.0.0.1 and its key (PEM paths), made by
    ``openssl``; skips the test when openssl is not installed."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return str(cert), str(key)
