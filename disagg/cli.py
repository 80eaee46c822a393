"""The `disagg` command: serve, generate, make-model."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time


def cmd_serve(args) -> int:
    from disagg.launcher import ClusterSpec, LocalCluster
    from disagg.tinymodel import ensure_tiny_model

    if args.model is None:
        print("Using the built-in tiny model (made on first use, ~20 s) ...", flush=True)
    model = args.model or str(ensure_tiny_model())
    spec = ClusterSpec(model=model, prefill_workers=args.prefill_workers, decode_workers=args.decode_workers, router_port=args.port, dtype=args.dtype, batch_size=args.batch_size)
    cluster = LocalCluster(spec)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    try:
        cluster.start()
        print(f"\ndisagg is serving {model}\n  router (GenerationService): {cluster.router_address}")
        for p in cluster.processes[:-1]:
            print(f"  {p.name}: {p.address}")
        print(f"\nTry:  disagg generate --address {cluster.router_address} \"The lighthouse keeper\"\nCtrl-C stops everything.", flush=True)
        while not stop["now"]:
            time.sleep(0.5)
            cluster.check_alive()
    except KeyboardInterrupt:
        pass
    finally:
        print("\nstopping ...", flush=True)
        codes = cluster.stop()
        print("stopped: " + ", ".join(f"{name} exit {code}" for name, code in codes.items()))
    return 0


def cmd_generate(args) -> int:
    from disagg.client import Client

    with Client(args.address, timeout=args.timeout, tls_ca=args.tls_ca, token=args.token) as client:
        last = None
        for chunk in client.generate(
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            stop=args.stop,
        ):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            last = chunk
        if last is not None:
            print(f"\n[{last.finish_reason}; {last.prompt_tokens} prompt + {last.completion_tokens} generated tokens; first token after {last.ttft_seconds * 1000:.1f} ms]", file=sys.stderr)
    return 0


def cmd_make_model(args) -> int:
    from disagg.tinymodel import TinyModelSpec, make_tiny_model

    path = make_tiny_model(args.out, TinyModelSpec(architecture=args.architecture, train_steps=args.train_steps))
    print(path)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="disagg", description="Disaggregated LLM inference over gRPC")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start a router, a prefill worker and a decode worker locally")
    serve.add_argument("--model", default=None, help="checkpoint directory or hub id (default: the built-in tiny model)")
    serve.add_argument("--port", type=int, default=int(os.environ.get("DISAGG_PORT", 50050)), help="router port")
    serve.add_argument("--prefill-workers", type=int, default=1)
    serve.add_argument("--decode-workers", type=int, default=1)
    serve.add_argument("--batch-size", type=int, default=8, help="decode slots per decode worker")
    serve.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    serve.set_defaults(run=cmd_serve)

    gen = sub.add_parser("generate", help="stream a generation to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--address", default="127.0.0.1:50050")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--timeout", type=float, default=120.0)
    gen.add_argument("--tls-ca", default=None, help="CA (PEM) of a router serving TLS")
    gen.add_argument("--token", default=os.environ.get("DISAGG_AUTH_TOKEN"), help="bearer token (default: $DISAGG_AUTH_TOKEN)")
    gen.set_defaults(run=cmd_generate)

    make = sub.add_parser("make-model", help="make a small trained checkpoint offline")
    make.add_argument("out")
    make.add_argument("--architecture", default="llama", choices=["llama", "qwen2", "mistral"])
    make.add_argument("--train-steps", type=int, default=300)
    make.set_defaults(run=cmd_make_model)

    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
