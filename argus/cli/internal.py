"""The internal-plane flags every service command takes (``argus allocator|router|worker|
controlnet``): ``--internal-tls-dir DIR`` (``ca.crt`` and the component's own certificate and
key, see :mod:`argus.plumbing.internal_tls`) or, explicitly, ``--insecure-internal``."""

from __future__ import annotations

import argparse
import sys

from argus.cli.main import CLIError


def add_internal_tls_arguments(parser: argparse.ArgumentParser, role: str) -> None:
    group = parser.add_argument_group("internal plane (mutual TLS between components)")
    plane = group.add_mutually_exclusive_group()
    plane.add_argument(
        "--internal-tls-dir",
        metavar="DIR",
        help=f"ca.crt, {role}.crt and {role}.key: this component's certificate of the cluster "
        "CA (argus issue-cert makes one)",
    )
    plane.add_argument(
        "--insecure-internal",
        action="store_true",
        help="plaintext and unauthenticated internal calls (local development only)",
    )


def internal_tls_dir(args: argparse.Namespace, command: str) -> str | None:
    """The certificate directory; None with ``--insecure-internal``, after a loud warning.
    CLIError when neither flag is given: the internal plane is authenticated by default."""
    if args.internal_tls_dir is not None:
        return str(args.internal_tls_dir)
    if not args.insecure_internal:
        raise CLIError(
            "--internal-tls-dir: required (a directory with ca.crt and this component's "
            f"certificate, see argus issue-cert); --insecure-internal runs argus {command} "
            "without authentication"
        )
    message = (
        f"WARNING: argus {command} --insecure-internal: internal calls are plaintext and "
        "unauthenticated; anyone who reaches this component can impersonate workers, "
        "routers or the allocator and read prompts. Use only on a trusted machine."
    )
    print(message, file=sys.stderr, flush=True)
    return None
