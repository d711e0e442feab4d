"""A cluster CA for tests, issued once per session (see ``cluster_ca`` in ``conftest.py``):
certificate directories and credentials for any role and name, and a rogue CA's for
handshakes that must fail."""

from __future__ import annotations

from pathlib import Path

import grpc

from argus.plumbing.internal_tls import Identity, InternalTLS, channel, generate_ca, issue


class TestCA:
    """A CA in ``root/ca``; each identity's directory is ``root/ROLE-NAME``, issued once."""

    __test__ = False  # not a test class, whatever its name

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca_dir = generate_ca(root / "ca")

    def directory(self, role: str, name: str) -> Path:
        """``ca.crt``, ``ROLE.crt``, ``ROLE.key`` for ``argus://ROLE/NAME``."""
        out = self.root / f"{role}-{name}"
        if not (out / f"{role}.crt").exists():
            issue(self.ca_dir, Identity(role, name), out)
        return out

    def tls(self, role: str, name: str) -> InternalTLS:
        return InternalTLS.load(self.directory(role, name), role)

    def channel(self, address: str, role: str, name: str = "test") -> grpc.Channel:
        """A mutual-TLS channel to ``address`` as ``argus://ROLE/NAME``."""
        return channel(address, self.tls(role, name))
