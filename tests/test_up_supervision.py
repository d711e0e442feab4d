"""``argus up`` supervises its parts: a killed worker comes back on its own and serves again;
a part that keeps dying stops the cluster with a non-zero exit naming it. Real processes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from argus.cli.up import GAVE_UP_EXIT
from argus.tools.client import Connection, RequestFailed, RouterClient

pytestmark = pytest.mark.e2e


BOUND_S = 240.0
WHILE_REJOINING = ("UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED")


class Up:
    """``argus up`` in a child process, its output collected line by line."""

    def __init__(self, workdir: Path, *extra: str) -> None:
        args = ["up", "--workers", "1", "--no-controlnet", "--no-metrics", "--steps", "4"]
        args += ["--port", "0", "--workdir", str(workdir), *extra]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "argus", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, after: int = 0) -> re.Match[str]:
        """The first line from index ``after`` on matching ``pattern``; fails on exit or bound."""
        deadline = time.monotonic() + BOUND_S
        while time.monotonic() < deadline:
            for line in self.lines[after:]:
                found = re.search(pattern, line)
                if found:
                    return found
            if self.process.poll() is not None and not self._reader.is_alive():
                pytest.fail(f"argus up exited before {pattern!r}:\n" + "\n".join(self.lines))
            time.sleep(0.1)
        pytest.fail(f"no {pattern!r} within {BOUND_S:.0f} s:\n" + "\n".join(self.lines))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # argus up stops its parts in order
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Up]:
    cluster = Up(tmp_path / "up", "--max-restarts", "2")
    try:
        yield cluster
    finally:
        cluster.stop()


def worker_pid(up: Up) -> int:
    """The pid of the live ``argus worker --worker-id worker-0`` among argus up's children."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent, state = int(stat[1]), stat[0]
        if parent == up.process.pid and state != "Z" and b"worker-0" in cmdline:
            return int(entry)
    pytest.fail("no live worker-0 process under argus up")


def test_a_killed_worker_is_restarted_and_one_that_keeps_dying_stops_up(up: Up) -> None:
    router = up.wait_for(r"argus up: router listening on (\S+)").group(1)
    up.wait_for(r"argus up: serving")
    first = worker_pid(up)
    os.kill(first, signal.SIGKILL)
    up.wait_for(r"argus up: worker-0 restarted")
    assert any("worker-0 exited with code -9; restarting it" in line for line in up.lines)
    with RouterClient(Connection(router)) as client:
        deadline = time.monotonic() + BOUND_S
        while True:  # the restarted worker warms up and rejoins the plan
            try:  # steps above the largest skip (K = 25): any level the plan picks runs
                reply = client.generate("a red bicycle", seed=1, steps=30, timeout_s=30.0)
                break
            except RequestFailed as err:
                if err.code.name not in WHILE_REJOINING or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    assert reply.worker_response.worker_id == "worker-0"
    second = worker_pid(up)
    assert second != first
    os.kill(second, signal.SIGKILL)  # the second death within the window: give up
    assert up.process.wait(BOUND_S) == GAVE_UP_EXIT
    up._reader.join(10)
    assert any("worker-0 died 2 times" in line for line in up.lines), "\n".join(up.lines)


def test_repeated_interrupts_still_stop_every_part(tmp_path: Path) -> None:
    """Ctrl-C pressed again while the cluster stops (or GNU timeout's SIGINT to the process
    and then to its group) is absorbed: every part is stopped in order, no traceback."""
    up = Up(tmp_path / "up")
    try:
        up.wait_for(r"argus up: serving")
        child = worker_pid(up)
        for _ in range(3):
            up.process.send_signal(signal.SIGINT)
            time.sleep(0.05)
        up.process.wait(120)
        up._reader.join(10)
        assert up.wait_for(r"argus up: stopped \((.*)\)").group(1).count("worker-0") == 1
        assert not any("Traceback" in line for line in up.lines), "\n".join(up.lines)
        assert up.process.returncode == 0
        assert (
            not Path(f"/proc/{child}").exists()
            or "Z" in Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[:1]
        )
    finally:
        up.stop()
