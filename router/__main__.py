"""python -m router: run the router (the public GenerationService)."""

from __future__ import annotations

import argparse
import asyncio
import os

from disagg.cli.flags import add_server_flags, address, internal_tls, resolve_model, setup_process
from disagg.rpc.security import tls_from_flags

from .config import Limits, RouterConfig


def build_parser() -> argparse.ArgumentParser:
    """Every flag of `python -m router`, without parsing anything (docs/configuration.md is made from it)."""
    parser = argparse.ArgumentParser(prog="router", description=__doc__)
    add_server_flags(parser, default_port=50050, default_metrics_port=9400)
    parser.add_argument("--model", default=None, help="checkpoint whose tokenizer and EOS ids to use (default: the built-in tiny model)")
    target_help = (
        "; or dns:///NAME:PORT for every address NAME resolves to, resolved again every --resolve-seconds"
        " (dns://DNS_SERVER/NAME:PORT asks that server). Repeat for several; both kinds mix"
    )
    parser.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT", help="a prefill worker at HOST:PORT" + target_help)
    parser.add_argument("--decode", action="append", default=[], metavar="HOST:PORT", help="a decode worker at HOST:PORT" + target_help)
    parser.add_argument(
        "--resolve-seconds", type=float, default=5.0, help="how often dns: worker targets are resolved again (default 5, CoreDNS's TTL for Services)"
    )
    parser.add_argument("--default-max-new-tokens", type=int, default=Limits.default_max_new_tokens)
    parser.add_argument("--max-new-tokens-cap", type=int, default=Limits.max_new_tokens_cap)
    parser.add_argument("--max-queue", type=int, default=256, help="requests that may wait for a decode slot")
    parser.add_argument("--worker-wait-seconds", type=float, default=RouterConfig.worker_wait_seconds,
                        help="with no prefill (or no decode) worker up, a request waits this long for one to come back (a restart)"
                        f" before it is answered UNAVAILABLE (default {RouterConfig.worker_wait_seconds:.0f}; 0: at once)")
    parser.add_argument("--public-tls-cert", help="TLS certificate (PEM) for the public port")
    parser.add_argument("--public-tls-key", help="its private key (PEM)")
    parser.add_argument(
        "--auth-token", default=os.environ.get("DISAGG_AUTH_TOKEN"),
        help="require 'authorization: Bearer <token>' on the public API (default: $DISAGG_AUTH_TOKEN)",
    )
    parser.add_argument(
        "--http-port", type=int, default=None,
        help="serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, ...) on this port,"
        " same host, TLS and token as the gRPC API (default: off; 0 picks a free port)",
    )
    parser.add_argument("--http-max-body-bytes", type=int, default=RouterConfig.http_max_body_bytes,
                        help="refuse an HTTP request body over this many bytes (413) before reading it in full"
                        " (default 4 MiB, as the gRPC API's message limit)")
    parser.add_argument("--http-timeout-seconds", type=float, default=RouterConfig.http_timeout_seconds,
                        help="an HTTP request still unanswered after this long ends with 504, freeing what it held (default 600)")
    parser.add_argument("--block-size", type=int, default=RouterConfig.block_size,
                        help="tokens per KV block, as the workers' --block-size: the unit in which the router counts a prompt's"
                        f" prefix as cached on a worker (default {RouterConfig.block_size})")
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=RouterConfig.prefix_caching,
                        help="cache-aware routing: send a prompt to the prefill and decode workers it sent the same prefix to before,"
                        " unless they are saturated (default on; --no-prefix-caching: by load alone)")
    parser.add_argument("--max-constraint-chars", type=int, default=Limits.max_constraint_chars,
                        help="refuse a constraint (JSON schema, regex, grammar, choices, tools' schemas) longer than this many characters"
                        f" (INVALID_ARGUMENT / 400) before compiling it (default {Limits.max_constraint_chars})")
    parser.add_argument("--constraint-compile-seconds", type=float, default=RouterConfig.constraint_compile_seconds,
                        help="refuse a constraint that does not compile within this many seconds (INVALID_ARGUMENT / 400);"
                        f" compiled constraints are cached by their text (default {RouterConfig.constraint_compile_seconds:g})")
    return parser


def parse_config(argv=None) -> RouterConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_process(args)
    try:
        return _config(args)
    except ValueError as exc:  # one line naming the flag, not a traceback
        parser.error(str(exc))


def _config(args) -> RouterConfig:
    return RouterConfig(
        model=resolve_model(args.model),
        prefill_workers=tuple(args.prefill),
        decode_workers=tuple(args.decode),
        address=address(args),
        limits=Limits(default_max_new_tokens=args.default_max_new_tokens, max_new_tokens_cap=args.max_new_tokens_cap,
                      max_constraint_chars=args.max_constraint_chars),
        constraint_compile_seconds=args.constraint_compile_seconds,
        max_queue=args.max_queue,
        worker_wait_seconds=args.worker_wait_seconds,
        resolve_seconds=args.resolve_seconds,
        grace_seconds=args.grace_seconds,
        metrics_port=args.metrics_port,
        port_file=args.port_file,
        tls=internal_tls(args),
        public_tls=tls_from_flags(args.public_tls_cert, args.public_tls_key, None, "--public-tls-cert/--public-tls-key"),
        auth_token=args.auth_token or None,
        http_port=args.http_port,
        http_max_body_bytes=args.http_max_body_bytes,
        http_timeout_seconds=args.http_timeout_seconds,
        block_size=args.block_size,
        prefix_caching=args.prefix_caching,
        test_long_tokenize_gate=os.environ.get("DISAGG_TEST_LONG_TOKENIZE_GATE"),
    )


def main(argv=None) -> None:
    from .server import serve

    asyncio.run(serve(parse_config(argv)))


if __name__ == "__main__":
    main()
