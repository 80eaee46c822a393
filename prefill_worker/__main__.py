"""python -m prefill_worker: run one prefill worker."""

from __future__ import annotations

import os

# OpenMP's threads sleep as soon as a parallel region ends, not spin (libgomp reads this once, as
# torch loads it: so before any import that may load torch). A prefill worker runs a torch thread
# per core it is given, and its products split evenly between them: with the cores busy with other
# processes (a decode worker's steps, the router), a spinning thread holds a core the working one
# needs, and a 900-token bf16 prefill on two threads took 8.6-9.7 s instead of 1.4-1.8 s (one
# thread: 1.4-1.9 s); with nothing else running, sleeping costs 0-10% (docs/benchmarks.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402

from disagg.cli.flags import add_model_flags, add_server_flags, run_worker, setup_process, worker_fields  # noqa: E402

from .config import PrefillWorkerConfig  # noqa: E402
from .peers import parse_pool  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    """Every flag of `python -m prefill_worker`, without parsing anything (docs/configuration.md is made from it)."""
    parser = argparse.ArgumentParser(prog="prefill_worker", description=__doc__)
    add_server_flags(parser, default_port=50051, default_metrics_port=9401)
    add_model_flags(parser)
    parser.add_argument("--kv-piece-bytes", type=int, default=4 * 1024 * 1024, help="largest KV piece in one gRPC message")
    parser.add_argument("--stream-kv", dest="stream_kv", action="store_true", default=None,
                        help="send KV layer by layer during prefill (default on accelerators)")
    parser.add_argument("--kv-staging-buffers", type=int, default=2, help="NIXL: prompts staged in registered memory for decode workers to read at once")
    parser.add_argument("--decode", action="append", default=[], metavar="TARGET",
                        help="required: a decode worker (HOST:PORT) or pool (dns:///NAME:PORT, resolved again as the router does) this worker may send KV to; "
                        "the router's --decode targets. A kv_target outside them is refused (PERMISSION_DENIED) and never dialled. Repeat for several")
    parser.add_argument("--no-stream-kv", dest="stream_kv", action="store_false", help="send KV after the first token (default on CPU)")
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="keep prompts' KV in blocks so a prompt that starts with cached blocks computes only the rest (default on; "
                             "off on the neuron backend, whose context encoding runs whole prompts)")
    parser.add_argument("--prefix-cache-gib", type=float, default=1.0, help="memory for the prefix cache's blocks, in GiB (0: no prefix cache)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per prefix cache block: prompts share whole blocks")
    parser.add_argument("--bind-compute-threads", action=argparse.BooleanOptionalAction, default=True,
                        help="on a CPU, bind torch's compute threads one per CPU where the worker has one per CPU it may run on (default on; "
                             "as vLLM's CPU build binds its OpenMP threads): a product split evenly never waits on two threads sharing a CPU")
    return parser


def parse_config(argv=None) -> PrefillWorkerConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_process(args)
    try:
        # Before worker_fields resolves --model (the default checkpoint is made on first use, tens of
        # seconds): a worker with no pool to send KV to refuses at once.
        parse_pool(tuple(args.decode))
    except ValueError as exc:
        parser.error(str(exc))
    shared, settings = worker_fields(args)
    try:
        return PrefillWorkerConfig(
            **shared,
            kv_piece_bytes=args.kv_piece_bytes,
            stream_kv_during_prefill=args.stream_kv,
            kv_staging_buffers=args.kv_staging_buffers,
            decode_peers=tuple(args.decode),
            prefix_caching=args.prefix_caching,
            prefix_cache_gib=args.prefix_cache_gib,
            block_size=args.block_size,
            bind_compute_threads=args.bind_compute_threads,
        )
    except ValueError as exc:  # one line naming the flag, not a traceback
        parser.error(str(exc))


def main(argv=None) -> None:
    try:
        config = parse_config(argv)  # a bad flag refuses before the server's modules (torch, the engine) are imported: seconds sooner
    except ValueError as exc:  # a setting out of range or a combination not served: one line, no traceback
        raise SystemExit(f"prefill_worker: {exc}") from None
    from .grpc_edge import serve

    run_worker("prefill_worker", serve, config)


if __name__ == "__main__":
    main()
