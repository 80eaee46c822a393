"""Where the router finds its workers: fixed addresses, and DNS names it resolves itself.

A worker target (`--prefill`, `--decode`) is either
- `HOST:PORT`: one worker, always there; or
- `dns:[//DNS_SERVER/]NAME:PORT` (gRPC's DNS target syntax): every address NAME
  resolves to is a worker listening on PORT. Without DNS_SERVER the system
  resolver answers (resolv.conf search domains and /etc/hosts included, as in a
  pod); with it (`dns://10.96.0.10:53/...`) the router asks that server
  directly over UDP. A Kubernetes headless Service answers with the addresses of
  its ready pods, so the router sees pods come and go by asking again.

A name that does not exist (NXDOMAIN) or has no addresses means no workers; a
lookup that fails (timeout, SERVFAIL) keeps the last answer, so a DNS blip never
drains a pool.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

DNS_QUERY_SECONDS = 2.0
_HOST_PORT = re.compile(r"^(?P<host>\[[0-9a-fA-F:.]+\]|[^:/\[\]]+):(?P<port>\d{1,5})$")


class LookupFailed(Exception):
    """The DNS lookup itself failed; the answer is unknown (not empty)."""


@dataclass(frozen=True)
class Target:
    text: str  # as given on the command line
    host: str
    port: int
    dns: bool = False  # re-resolved; otherwise a fixed address
    dns_server: tuple[str, int] | None = None  # ask this server, not the system resolver

    @property
    def address(self) -> str:
        return join_host_port(self.host, self.port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def canonical_address(text: str, what: str = "address") -> str:
    """HOST:PORT with an IP written one way (ipaddress's form) and a name in lower case, so two
    spellings of one address compare equal; ValueError (naming `what`) for anything else."""
    host, port = _split(text, what)
    try:
        host = str(ipaddress.ip_address(host))
    except ValueError:
        host = host.lower().rstrip(".")
    return join_host_port(host, port)


def _split(text: str, what: str) -> tuple[str, int]:
    match = _HOST_PORT.match(text)
    if not match or not 0 < int(match["port"]) < 65536:
        raise ValueError(f"{what}: {text!r} is not HOST:PORT")
    return match["host"].strip("[]"), int(match["port"])


def parse_target(text: str, flag: str = "--prefill/--decode") -> Target:
    """HOST:PORT, or dns:[//DNS_SERVER/]NAME:PORT; ValueError names the flag."""
    if not text.startswith("dns:"):
        host, port = _split(text, flag)
        return Target(text, host, port)
    rest = text[len("dns:") :]
    server = None
    if rest.startswith("//"):
        authority, slash, rest = rest[2:].partition("/")
        if not slash:
            raise ValueError(f"{flag}: {text!r}: write dns:///NAME:PORT, or dns://DNS_SERVER/NAME:PORT")
        if authority:
            host, port = _split(authority if ":" in authority.strip("[]") else f"{authority}:53", f"{flag} DNS server")
            server = (host, port)
    host, port = _split(rest, flag)
    return Target(text, host, port, dns=True, dns_server=server)


Resolver = Callable[[Target], Awaitable[frozenset[str]]]


async def resolve(target: Target) -> frozenset[str]:
    """The worker addresses (HOST:PORT) that a target names now."""
    if not target.dns:
        return frozenset({target.address})
    if target.dns_server is None:
        hosts = await _system_lookup(target.host)
    else:
        hosts = await asyncio.get_running_loop().run_in_executor(None, _ask_server, target.host, target.dns_server)
    return frozenset(join_host_port(host, target.port) for host in hosts)


async def _system_lookup(name: str) -> set[str]:
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            return set()
        raise LookupFailed(f"{name}: {exc.strerror}") from exc
    return {info[4][0] for info in infos}


def _ask_server(name: str, server: tuple[str, int]) -> set[str]:
    """A and AAAA records of name from one DNS server (UDP; blocking: run off the loop)."""
    from dnslib import QTYPE, RCODE, DNSRecord

    hosts: set[str] = set()
    for qtype in ("A", "AAAA"):
        try:
            reply = DNSRecord.parse(DNSRecord.question(name, qtype).send(server[0], server[1], timeout=DNS_QUERY_SECONDS))
        except (OSError, ValueError) as exc:  # socket.timeout is an OSError
            raise LookupFailed(f"{name} from {server[0]}:{server[1]}: {exc or type(exc).__name__}") from exc
        rcode = reply.header.rcode
        if rcode == RCODE.NXDOMAIN:
            return set()
        if rcode != RCODE.NOERROR:
            raise LookupFailed(f"{name} from {server[0]}:{server[1]}: {RCODE.get(rcode)}")
        hosts |= {str(ipaddress.ip_address(str(rr.rdata))) for rr in reply.rr if rr.rtype in (QTYPE.A, QTYPE.AAAA)}
    return hosts
