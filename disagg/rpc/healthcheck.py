"""python -m disagg.rpc.healthcheck HOST:PORT: exit 0 when the server's grpc.health.v1 says SERVING.

What the Helm chart's probes run where Kubernetes' own gRPC probe cannot: the
kubelet's probe speaks plaintext only, and with mutual TLS the workers accept
no client without a certificate. `--service liveness` asks the status that
stays SERVING while the process runs (model loading and draining included).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def channel(address: str, args) -> grpc.Channel:
    if not args.tls_ca:
        return grpc.insecure_channel(address)
    def read(path: str | None) -> bytes | None:
        return pathlib.Path(path).read_bytes() if path else None

    credentials = grpc.ssl_channel_credentials(read(args.tls_ca), read(args.tls_key), read(args.tls_cert))
    options = [("grpc.ssl_target_name_override", args.tls_server_name)] if args.tls_server_name else []
    return grpc.secure_channel(address, credentials, options=options)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="disagg.rpc.healthcheck", description=__doc__)
    parser.add_argument("address", help="HOST:PORT of the server")
    parser.add_argument("--service", default="", help='health service name ("": ready for work; liveness: the process runs)')
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--tls-cert")
    parser.add_argument("--tls-key")
    parser.add_argument("--tls-ca", help="check the server's certificate with this CA (TLS); with --tls-cert/--tls-key, mutual TLS")
    parser.add_argument("--tls-server-name", help="name the server's certificate carries, if not the host dialled")
    args = parser.parse_args(argv)
    with channel(args.address, args) as ch:
        try:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout).status
        except grpc.RpcError as exc:
            print(f"{args.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    print(f"{args.address} {args.service or '(server)'}: {name}")
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1


if __name__ == "__main__":
    sys.exit(main())
