"""Starting a real ``argus`` service process in a test and finding the address it bound; a
self-signed certificate for TLS tests."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
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
