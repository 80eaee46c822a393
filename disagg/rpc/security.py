"""TLS, mutual TLS and the bearer token, from files and flags named in the config.

- Internal links (router -> workers, prefill -> decode KV) use mutual TLS when
  `--tls-cert/--tls-key/--tls-ca` are given: servers require a client
  certificate signed by the CA, clients present theirs.
- The router's public port uses `--public-tls-cert/--public-tls-key`.
- `--auth-token` (or DISAGG_AUTH_TOKEN) requires `authorization: Bearer <token>`
  on every public call but the health check, which stays open for probes.
"""

from __future__ import annotations

import hmac
import pathlib
from dataclasses import dataclass

import grpc

from disagg.rpc.server import channel_options, refusal

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


@dataclass(frozen=True)
class TlsFiles:
    cert: str
    key: str
    ca: str | None = None  # verifies the peer; for a server, required for mutual TLS
    # Check peers' certificates against this name rather than the host dialled:
    # pods are dialled by IP (from DNS) and share one certificate for a name.
    server_name: str | None = None

    def __post_init__(self):
        for name in ("cert", "key", "ca"):
            path = getattr(self, name)
            if path is not None and not pathlib.Path(path).is_file():
                raise ValueError(f"TLS {name} file {path!r} does not exist")

    def _read(self, path: str | None) -> bytes | None:
        return pathlib.Path(path).read_bytes() if path else None

    def server_credentials(self, require_client_cert: bool) -> grpc.ServerCredentials:
        if require_client_cert and not self.ca:
            raise ValueError("mutual TLS needs a CA file to check client certificates")
        return grpc.ssl_server_credentials(
            [(self._read(self.key), self._read(self.cert))],
            root_certificates=self._read(self.ca),
            require_client_auth=require_client_cert,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self._read(self.ca), private_key=self._read(self.key), certificate_chain=self._read(self.cert))


def tls_from_flags(cert: str | None, key: str | None, ca: str | None, what: str) -> TlsFiles | None:
    if not cert and not key:
        if ca:
            raise ValueError(f"{what}: a CA file was given without a certificate and key")
        return None
    if not (cert and key):
        raise ValueError(f"{what}: give both a certificate and a key")
    return TlsFiles(cert, key, ca)


def open_channel(address: str, tls: TlsFiles | None, max_message_bytes: int | None = None) -> grpc.aio.Channel:
    options = channel_options(max_message_bytes) if max_message_bytes else channel_options()
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    if tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        if details.method.startswith(OPEN_METHOD_PREFIXES):
            return await continuation(details)
        given = dict(details.invocation_metadata or ()).get("authorization")
        if given is None:
            return refusal(grpc.StatusCode.UNAUTHENTICATED, "missing authorization metadata: send 'authorization: Bearer <token>'")
        if not hmac.compare_digest(given.encode() if isinstance(given, str) else given, self._expected):
            return refusal(grpc.StatusCode.UNAUTHENTICATED, "authorization token is not valid")
        return await continuation(details)
