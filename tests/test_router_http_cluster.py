"""A taken HTTP port stops ``argus router``, naming it (the HTTP API end to end on a local
cluster is in ``test_cluster_processes.py``, on its secured cluster)."""

from __future__ import annotations

import socket
import subprocess
import sys


def test_taken_http_port_stops_the_router_naming_it() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        command = [sys.executable, "-m", "argus", "router", "--allocator", "127.0.0.1:1"]
        result = subprocess.run(
            [*command, "--insecure-internal", "--http-port", str(port)],
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
    assert result.returncode != 0
    assert f"127.0.0.1:{port}" in result.stderr and "--http-port" in result.stderr
    assert "Traceback" not in result.stderr
