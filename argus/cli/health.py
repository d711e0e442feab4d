"""``argus health``: one standard gRPC health check of an internal service, over its mutual
TLS; exit 0 when SERVING, 1 otherwise.

Internal services accept only certificates of the cluster CA, so a plain gRPC probe cannot
connect: the Helm chart's probes run this command in the pod (an exec probe), with the pod's
own certificate. It imports grpc alone, so it starts fast.
"""

from __future__ import annotations

import argparse
import sys

from argus.cli.main import CLIError


class HealthCommand:
    name = "health"
    help = "Check an internal service's gRPC health with this pod's certificate."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--address", default="127.0.0.1:50051", help="HOST:PORT to check")
        parser.add_argument("--service", default="", help="service name ('' = the server)")
        parser.add_argument(
            "--internal-tls-dir", help="ca.crt and the ROLE.crt / ROLE.key to present"
        )
        parser.add_argument("--role", required=True, help="whose certificate in that directory")
        parser.add_argument("--timeout-s", type=float, default=2.0)

    def run(self, args: argparse.Namespace) -> int:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from argus.plumbing.internal_tls import InternalTLS, channel

        try:
            tls = (
                None
                if args.internal_tls_dir is None
                else InternalTLS.load(args.internal_tls_dir, args.role)
            )
        except OSError as err:
            raise CLIError(str(err)) from None
        with channel(args.address, tls) as ch:
            try:
                reply = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout_s
                )
            except grpc.RpcError as err:
                print(f"argus health: {args.address}: {err.code().name}", file=sys.stderr)
                return 1
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        print(f"argus health: {args.address}: {status}")
        return 0 if status == "SERVING" else 1
