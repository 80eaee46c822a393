"""python -m decode_worker: run one decode worker."""

from __future__ import annotations

import argparse

from disagg.cli.flags import add_model_flags, add_server_flags, run_worker, setup_process, worker_fields

from .config import DecodeWorkerConfig


def build_parser() -> argparse.ArgumentParser:
    """Every flag of `python -m decode_worker`, without parsing anything (docs/configuration.md is made from it)."""
    parser = argparse.ArgumentParser(prog="decode_worker", description=__doc__)
    add_server_flags(parser, default_port=50061, default_metrics_port=9402)
    add_model_flags(parser)
    parser.add_argument(
        "--batch-size", type=int, default=0,
        help="decode slots: requests decoded together (default: as many as --kv-cache-gib holds, at most --max-batch-size; 8 on the neuron backend)",
    )
    parser.add_argument(
        "--kv-cache-gib", type=float, default=4.0,
        help="memory for the slot cache when --batch-size is not given (default 4, as vLLM's CPU KV cache space)",
    )
    parser.add_argument("--max-batch-size", type=int, default=64, help="at most this many slots when sized from --kv-cache-gib")
    parser.add_argument("--no-async", dest="async_mode", action="store_false", help="turn async mode off (host and device work in turn)")
    parser.add_argument("--colocated", action="store_true", help="also serve prefill from this process (one worker doing both phases)")
    parser.add_argument("--lease-seconds", type=float, default=30.0, help="how long a reserved slot waits for its KV")
    parser.add_argument("--block-size", type=int, default=16, help="KV positions per block of the paged KV cache (default 16, as vLLM)")
    parser.add_argument(
        "--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="keep full KV blocks of earlier prompts and reuse them for prompts that share the prefix (default on)",
    )
    return parser


def parse_config(argv=None) -> DecodeWorkerConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_process(args)
    shared, settings = worker_fields(args)
    return DecodeWorkerConfig(
        **shared,
        batch_size=settings.get("batch_size", args.batch_size),
        kv_cache_gib=args.kv_cache_gib,
        max_batch_size=args.max_batch_size,
        async_mode=args.async_mode,
        lease_seconds=args.lease_seconds,
        colocated=args.colocated,
        block_size=args.block_size,
        prefix_caching=args.prefix_caching,
    )


def main(argv=None) -> None:
    try:
        config = parse_config(argv)  # a bad flag refuses before the server's modules (torch, the engine) are imported: seconds sooner
    except ValueError as exc:  # a setting out of range or a combination not served: one line, no traceback
        raise SystemExit(f"decode_worker: {exc}") from None
    from .grpc_edge import serve

    run_worker("decode_worker", serve, config)


if __name__ == "__main__":
    main()
