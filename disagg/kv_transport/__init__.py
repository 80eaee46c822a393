"""How KV moves from a prefill worker into a decode worker's slot.

- `grpc_push`: the gRPC stream (the portable fallback). The prefill worker streams
  KvChunk pieces (`chunk_codec` cuts and checks them) to the decode worker's PushKv,
  which copies each into the reserved slot.
- `nixl_control` + `nixl_transport`: NIXL. The prefill worker stages the KV in
  registered memory and calls PullKv; the decode worker reads it straight into
  the slot with NIXL, then commits. `layout` is the byte geometry both share.

Control (reservations, commit, acknowledgement, leases, cancellation) is gRPC
in both. `--kv-transport auto` takes NIXL where it is installed and loads.

The default is `auto`: NIXL where it loads. Neither side runs NIXL's own
progress thread (it spins a core for the agent's life); the side read from is
progressed only while a read may be running (`nixl_transport.PassiveProgress`).
"""

TRANSPORTS = ("grpc", "nixl")
CHOICES = ("auto", *TRANSPORTS)
DEFAULT = "auto"


def resolve(choice: str) -> str:
    """The transport a worker opens for --kv-transport `choice`."""
    if choice != "auto":
        return choice
    from .nixl_transport import available

    return "nixl" if available() else "grpc"


def open_fallible(open_nixl, config):
    """open_nixl(), or None where NIXL does not load and --kv-transport auto lets the worker use gRPC."""
    import logging

    from .nixl_transport import NixlUnavailable

    try:
        return open_nixl()
    except NixlUnavailable as exc:
        if not config.kv_transport_fallback:
            raise
        logging.getLogger(__name__).warning("KV transport: %s; using the gRPC stream", exc)
        return None
