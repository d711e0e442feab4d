"""Test-session settings that must be in place before any test module imports grpc."""

import os

# Tests start real worker processes (subprocess, fork + exec) while the test process holds
# live gRPC channels; grpc's fork handlers can then stall the parent's new connections.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import pytest

from tests.tls_factories import TestCA


@pytest.fixture(scope="session")
def cluster_ca(tmp_path_factory: pytest.TempPathFactory) -> TestCA:
    """One cluster CA for the session; tests issue the certificates they need from it."""
    return TestCA(tmp_path_factory.mktemp("cluster-ca"))
