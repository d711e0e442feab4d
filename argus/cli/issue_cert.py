"""``argus issue-cert``: a cluster CA, or one component's certificate signed by it.

``argus issue-cert --new-ca --ca-dir CA`` creates ``CA/ca.crt`` and ``CA/ca.key`` (EC P-256).
``argus issue-cert --ca-dir CA --identity worker/worker-1 --out DIR`` writes ``DIR/ca.crt``,
``DIR/worker.crt`` and ``DIR/worker.key`` (mode 0600): what ``argus worker
--internal-tls-dir DIR`` reads. The Helm chart runs it in each pod's init container, so the
serving container never sees the CA key.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from argus.cli.main import CLIError


class IssueCertCommand:
    name = "issue-cert"
    help = "Create the cluster CA, or issue a component's certificate for the internal plane."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--ca-dir", required=True, help="directory of ca.crt and ca.key")
        parser.add_argument("--new-ca", action="store_true", help="create the CA in --ca-dir")
        parser.add_argument(
            "--identity", help="ROLE/NAME (roles: allocator, router, worker, controlnet, operator)"
        )
        parser.add_argument("--out", type=Path, help="the component's certificate directory")

    def run(self, args: argparse.Namespace) -> int:
        from argus.plumbing.internal_tls import Identity, generate_ca, issue

        if args.new_ca:
            if args.identity is not None or args.out is not None:
                raise CLIError("--new-ca: creates the CA only; issue certificates separately")
            if (Path(args.ca_dir) / "ca.key").exists():
                raise CLIError(f"--ca-dir: {args.ca_dir} already holds a CA key; not replaced")
            generate_ca(args.ca_dir)
            print(f"argus issue-cert: CA in {args.ca_dir}", flush=True)
            return 0
        if args.identity is None or args.out is None:
            raise CLIError("--identity and --out: both required to issue a certificate")
        try:
            identity = Identity.parse(args.identity)
            issue(args.ca_dir, identity, args.out)
        except (ValueError, OSError) as err:
            raise CLIError(str(err)) from None
        print(f"argus issue-cert: {identity.uri} in {args.out}", flush=True)
        return 0
