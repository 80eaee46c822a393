"""The `disagg` command: serve, generate, make-model."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from disagg.kv_transport import CHOICES as KV_CHOICES
from disagg.kv_transport import DEFAULT as KV_DEFAULT


def free_or_any(port: int) -> int:
    """port if it can be bound on 127.0.0.1, else 0 (any free port): a taken
    default HTTP port does not stop the demo; the banner prints the one used."""
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            print(f"HTTP port {port} is in use: the HTTP API takes a free port instead (printed below)", flush=True)
            return 0
    return port


def neuron_placement(args):
    """--backend neuron: each role's tp and the NeuronCores found (None for the torch backend)."""
    from disagg.tools.local_cluster import NeuronPlacement
    from disagg.tools.neuron_cores import discover

    if args.backend != "neuron":
        return None
    return NeuronPlacement(discover(args.neuron_cores), prefill_tp=args.prefill_tp or args.tp, decode_tp=args.decode_tp or args.tp)


def serve_worker_args(args) -> list[str]:
    """Flags every worker gets from `disagg serve`."""
    out = ["--kv-transport", args.kv_transport]
    if args.max_seq_len:
        out += ["--max-seq-len", str(args.max_seq_len)]
    if args.neuron_compiled_path:
        out += ["--neuron-compiled-path", args.neuron_compiled_path]
    if not args.share_weights:
        out += ["--no-share-weights"]
    return out + quantization_flags(args) + cache_flags(args) + speculation_flags(args)


def speculation_flags(args) -> list[str]:
    """--speculative-method and its settings, where given: every worker gets them (the decode workers speculate)."""
    if args.speculative_method is None:
        return []
    out = ["--speculative-method", args.speculative_method] + (["--draft-model", args.draft_model] if args.draft_model else [])
    return out + (["--num-speculative-tokens", str(args.num_speculative_tokens)] if args.num_speculative_tokens else [])


def quantization_flags(args) -> list[str]:
    """--quantization and its settings, and --kv-cache-dtype, where given: both workers serve the same weights and KV."""
    kv = [] if args.kv_cache_dtype == "auto" else ["--kv-cache-dtype", args.kv_cache_dtype]
    if args.quantization is None:
        return kv
    return kv + ["--quantization", args.quantization, "--quantization-type", args.quantization_type, "--quantization-skip", ",".join(args.quantization_skip)]


def cache_flags(args) -> list[str]:
    """The KV block size and prefix caching, where given: the router's index and both workers' caches alike."""
    out = [] if args.block_size is None else ["--block-size", str(args.block_size)]
    if args.prefix_caching is not None:
        out += ["--prefix-caching" if args.prefix_caching else "--no-prefix-caching"]
    return out


def serve_router_args(args) -> list[str]:
    """Flags the router gets from `disagg serve` (only those given: the router's defaults otherwise)."""
    out = []
    if args.http_max_body_bytes is not None:
        out += ["--http-max-body-bytes", str(args.http_max_body_bytes)]
    if args.http_timeout_seconds is not None:
        out += ["--http-timeout-seconds", str(args.http_timeout_seconds)]
    return out + cache_flags(args)


def print_banner(cluster, model: str) -> None:
    print(f"\ndisagg is serving {model}\n  router (GenerationService): {cluster.router_address}")
    if cluster.http_url:
        print(f"  OpenAI-compatible HTTP API: {cluster.http_url}/v1")
    for p in cluster.processes[:-1]:
        print(f"  {p.name}: {p.address}")
    print(f"\nTry:  disagg generate --address {cluster.router_address} \"The lighthouse keeper\"")
    if cluster.http_url:
        print(f"      curl {cluster.http_url}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{{\"prompt\": \"The lighthouse keeper\", \"max_tokens\": 16}}'")
    print("Ctrl-C stops everything.", flush=True)


def serve_spec(args):
    """The local cluster `disagg serve` starts. Its decode workers get --decode-nice where a
    prefill worker's products share their CPU cores (not colocated, not on NeuronCores)."""
    from disagg.tools.local_cluster import ClusterSpec, decode_nice

    http_port = None if args.http_port < 0 else free_or_any(args.http_port) if args.http_port else 0
    neuron = neuron_placement(args)
    return ClusterSpec(model=args.model or "", prefill_workers=args.prefill_workers, decode_workers=args.decode_workers, router_port=args.port,
                       decode_args=["--kv-cache-gib", str(args.kv_cache_gib)], prefill_args=["--prefix-cache-gib", str(args.prefix_cache_gib)],
                       http_port=http_port, dtype=args.dtype, batch_size=args.batch_size, colocated=args.colocated, neuron=neuron,
                       worker_args=serve_worker_args(args), router_args=serve_router_args(args), threads_per_worker=args.threads,
                       nice=decode_nice(args.decode_nice, args.colocated or neuron is not None), silence=args.start_silence)


def check_memory(spec, args) -> None:
    """NotEnoughMemory where the workers `disagg serve` would start do not fit together in the memory
    this machine (or its cgroup) has free: each worker checks only itself as it starts, and workers
    loading side by side would each still see the memory free."""
    from decode_worker.config import DecodeWorkerConfig
    from disagg.engine import memory
    from prefill_worker.config import PrefillWorkerConfig

    facts = memory.CheckpointFacts.read(spec.model) if spec.neuron is None else None
    if facts is None:
        return
    flags = {"model": spec.model, "dtype": spec.dtype, "max_seq_len": args.max_seq_len, "share_weights": args.share_weights,
             "quantization": args.quantization, "quantization_skip": args.quantization_skip}
    flags.update({} if args.block_size is None else {"block_size": args.block_size})
    flags.update({} if args.prefix_caching is None else {"prefix_caching": args.prefix_caching})
    decode = DecodeWorkerConfig(**flags, batch_size=spec.batch_size, kv_cache_gib=args.kv_cache_gib, colocated=spec.colocated)
    needs = [decode.memory_need(facts)] * spec.decode_workers
    if not spec.colocated:  # (the pool is settled at start; what a prefill worker holds does not depend on it)
        prefill = PrefillWorkerConfig(**flags, prefix_cache_gib=args.prefix_cache_gib, decode_peers=("127.0.0.1:1",))
        needs += [prefill.memory_need(facts)] * spec.prefill_workers
    memory.check_fits(needs, f"its {len(needs)} workers", "lower --kv-cache-gib, --prefix-cache-gib, --batch-size or --max-seq-len, "
                      "use --dtype bfloat16, or start fewer workers")


def restart_policy(args):
    from disagg.tools.supervisor import RestartPolicy

    return RestartPolicy(limit=args.restart_limit, window=args.restart_window, silence=args.start_silence)


def cmd_serve(args) -> int:
    from disagg.engine.memory import NotEnoughMemory
    from disagg.tools.local_cluster import LocalCluster
    from disagg.tools.neuron_cores import NotEnoughCores
    from disagg.tools.supervisor import Supervisor
    from disagg.tools.tinymodel import ensure_tiny_model

    spec, policy = serve_spec(args), restart_policy(args)
    try:
        cores = spec.neuron_cores()  # the one-line refusal comes before anything starts
    except NotEnoughCores as exc:
        print(f"disagg serve: {exc}", file=sys.stderr)
        return 2
    if args.model is None:
        print("Using the built-in tiny model (made on first use, ~20 s) ...", flush=True)
        spec.model = str(ensure_tiny_model())
    model = spec.model
    try:
        check_memory(spec, args)  # every worker's need, summed, before any starts
    except NotEnoughMemory as exc:
        print(f"disagg serve: {exc}", file=sys.stderr)
        return 2
    if cores:
        print(f"NeuronCores ({spec.neuron.pool.source}): " + ", ".join(f"{name} {visible}" for name, visible in cores.items()), flush=True)
    cluster = LocalCluster(spec, progress=lambda line: print(line, flush=True))
    stop, status = {"now": False, "started": False}, 0

    def on_signal(*_):
        stop.update(now=True)
        if not stop["started"]:  # a first compile can take many minutes: stop waiting for it
            raise KeyboardInterrupt

    # Both set explicitly: a shell's background job inherits SIGINT ignored, and Ctrl-C
    # (or a supervisor's SIGINT) must still stop everything.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        cluster.start()
        stop["started"] = True
        print_banner(cluster, model)
        # From here a part that exits is restarted and the others serve meanwhile (disagg/tools/supervisor.py).
        supervisor = Supervisor(cluster, policy, say=lambda line: print(line, flush=True))
        while not stop["now"]:
            time.sleep(0.2)
            supervisor.poll()
    except KeyboardInterrupt:
        pass
    except (RuntimeError, TimeoutError) as exc:  # a part failed its start, or a worker is stuck: its own log says why
        print(f"disagg serve: {exc}", file=sys.stderr, flush=True)
        status = 1
    finally:
        stop["started"] = True  # a second signal no longer interrupts: stop() below ends everything
        print("\nstopping ...", flush=True)
        codes = cluster.stop()
        print("stopped: " + ", ".join(f"{name} exit {code}" for name, code in codes.items()))
    return status


def cmd_generate(args) -> int:
    from disagg.clients.grpc_client import Client

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
            print(f"\n[{last.finish_reason}; {last.prompt_tokens} prompt + {last.completion_tokens} "
                  f"generated tokens; first token after {last.ttft_seconds * 1000:.1f} ms]",
                  file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    import asyncio
    import json

    from disagg.tools.loadgen import BenchConfig, plot, run_bench, table

    if args.api == "openai" and (args.url is None) == (not args.start_cluster):
        print("disagg bench: --api openai needs either --url (the server's base URL) or --start-cluster (ours, over HTTP)", file=sys.stderr)
        return 2
    config = BenchConfig(
        address=args.url if args.api == "openai" else args.address,
        api=args.api,
        requests=args.requests,
        rate=args.rate,
        sweep=[float(r) for r in args.sweep.split(",")] if args.sweep else [],
        concurrency=args.concurrency,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        dataset=args.dataset,
        warmup=args.warmup,
        duration=args.duration,
        ttft_target=args.ttft_target / 1000,
        itl_target=args.itl_target / 1000,
        seed=args.seed,
        progress=not args.no_progress,
        metrics=args.metrics,
    )
    cluster = None
    if args.start_cluster:
        from disagg.tools.local_cluster import ClusterSpec, LocalCluster
        from disagg.tools.tinymodel import ensure_tiny_model

        http_port = 0 if args.api == "openai" else None
        spec = ClusterSpec(model=args.model or str(ensure_tiny_model()), log_dir=args.log_dir, http_port=http_port, worker_args=speculation_flags(args))
        cluster = LocalCluster(spec).start()
        config.address = cluster.http_url if args.api == "openai" else cluster.router_address
        config.metrics = config.metrics or [p.metrics_address for p in cluster.processes if p.name.startswith("decode")]
    try:
        runs = asyncio.run(run_bench(config))
    finally:
        if cluster is not None:
            cluster.stop()
    for run in runs:
        print(table(run))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in run.items() if k != "_raw"} for run in runs], f, indent=2)
    if args.plot:
        print("plots: " + ", ".join(plot(runs, args.plot)))
    return 0 if all(run["ok"] for run in runs) else 1


def cmd_make_model(args) -> int:
    from disagg.tools.tinymodel import TinyModelSpec, make_tiny_model

    path = make_tiny_model(args.out, TinyModelSpec(architecture=args.architecture, train_steps=args.train_steps))
    print(path)
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="disagg", description="Disaggregated LLM inference over gRPC")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    add_generate_parser(sub)
    add_bench_parser(sub)
    add_make_model_parser(sub)
    return parser


def add_serve_parser(sub) -> None:
    from decode_worker.config import DecodeWorkerConfig
    from disagg.cli.flags import add_quantization_flags, add_speculation_flags
    from disagg.tools.local_cluster import DECODE_NICE
    from prefill_worker.config import PrefillWorkerConfig

    serve = sub.add_parser("serve", help="start a router, a prefill worker and a decode worker locally")
    serve.add_argument("--model", default=None, help="checkpoint directory or hub id (default: the built-in tiny model)")
    serve.add_argument("--port", type=int, default=int(os.environ.get("DISAGG_PORT", 50050)), help="router port")
    serve.add_argument("--http-port", type=int, default=int(os.environ.get("DISAGG_HTTP_PORT", 8000)),
                       help="the router's OpenAI-compatible HTTP API (default 8000, or a free port when 8000 is taken; 0: a free port; -1: off)")
    serve.add_argument("--http-max-body-bytes", type=int, default=None,
                       help="refuse an HTTP request body over this many bytes (413) before reading it in full (default 4 MiB, as the gRPC API's)")
    serve.add_argument("--http-timeout-seconds", type=float, default=None, help="an HTTP request still unanswered after this long ends with 504 (default 600)")
    serve.add_argument("--prefill-workers", type=int, default=1)
    serve.add_argument("--decode-workers", type=int, default=1)
    serve.add_argument("--threads", type=int, default=0, help="torch CPU threads per worker (default 0: a prefill worker its share of the machine's cores "
                            "among the prefill workers, a decode worker its share among all the workers)")
    serve.add_argument("--decode-nice", type=int, choices=range(20), default=DECODE_NICE, metavar="0-19",
                       help=f"the decode workers' niceness, of their threads and their scheduling group (default {DECODE_NICE}; 0: none): "
                            "a prefill running on the same cores takes them first and the streams go on in what it leaves, so a long "
                            "prompt's TTFT is not held back by the streams beside it (docs/architecture.md)")
    serve.add_argument("--batch-size", type=int, default=0,
                       help="decode slots per decode worker (default: sized from the decode worker's --kv-cache-gib, at most 64)")
    serve.add_argument("--kv-cache-gib", type=float, default=DecodeWorkerConfig.kv_cache_gib,
                       help=f"each decode worker's KV cache memory (default {DecodeWorkerConfig.kv_cache_gib:g}; "
                            "less with --batch-size where fewer sequences fill less)")
    serve.add_argument("--prefix-cache-gib", type=float, default=PrefillWorkerConfig.prefix_cache_gib,
                       help=f"each prefill worker's prefix cache memory (default {PrefillWorkerConfig.prefix_cache_gib:g}; 0: none)")
    serve.add_argument("--share-weights", action=argparse.BooleanOptionalAction, default=True,
                       help="the workers map one file of the prepacked weights, so the machine holds them once (default); "
                            "--no-share-weights gives each worker its own copy")
    add_quantization_flags(serve)
    add_speculation_flags(serve)
    serve.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                        help="auto: bfloat16 on a CPU with native bf16 (AVX512_BF16, AMX), float32 on others, the checkpoint's own on CUDA, bf16 on Neuron")
    serve.add_argument("--kv-transport", default=KV_DEFAULT, choices=KV_CHOICES,
                       help="how KV moves from prefill to decode (nixl: read straight into the slot, needs "
                            "nixl-cu12; auto: NIXL where it is installed, else the gRPC stream)")
    serve.add_argument("--colocated", action="store_true", help="no prefill workers: each decode worker also prefills (the baseline)")
    serve.add_argument("--max-seq-len", type=int, default=0, help="prompt plus generated tokens (default: the workers' default)")
    serve.add_argument("--block-size", type=int, default=None, help="tokens per KV block, the unit of prefix caching (default 16)")
    serve.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                       help="cache-aware routing: a prompt goes to the workers its prefix was sent to before, unless they are saturated (default on)")
    add_supervision_arguments(serve)
    add_neuron_arguments(serve)
    serve.set_defaults(run=cmd_serve)


def add_supervision_arguments(serve) -> None:
    from disagg.tools.supervisor import RestartPolicy

    default = RestartPolicy()
    group = serve.add_argument_group("supervision: a part that exits is restarted on its ports (docs/reliability.md)")
    group.add_argument("--restart-limit", type=positive_int, default=default.limit,
                       help=f"a part that exits more than this many times in --restart-window is left down while others of its role serve "
                            f"(the last of its role is tried again every {default.max_delay:.0f} s instead; default {default.limit})")
    group.add_argument("--restart-window", type=positive_float, default=default.window, help=f"seconds (default {default.window:.0f})")
    group.add_argument("--start-silence", type=positive_float, default=default.silence,
                       help="a starting part may take as long as it makes progress (CPU time, a new start-up phase); one silent for "
                            f"this many seconds has failed its start (default {default.silence:.0f})")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def add_neuron_arguments(serve) -> None:
    neuron = serve.add_argument_group("--backend neuron (Trn1, Inf2, Trn2; docs/neuron.md)")
    neuron.add_argument("--backend", default="torch", choices=["torch", "neuron"])
    neuron.add_argument("--tp", type=int, default=1, help="NeuronCores per worker (NxDI's tp_degree); each worker gets its own (NEURON_RT_VISIBLE_CORES)")
    neuron.add_argument("--prefill-tp", type=int, default=0, help="the prefill workers' tp (default --tp)")
    neuron.add_argument("--decode-tp", type=int, default=0, help="the decode workers' tp (default --tp)")
    neuron.add_argument("--neuron-cores", type=int, default=int(os.environ.get("DISAGG_NEURON_CORES", 0)),
                        help="NeuronCores to split between the workers (default $DISAGG_NEURON_CORES, else "
                             "$NEURON_RT_VISIBLE_CORES, else the driver's sysfs, else neuron-ls)")
    neuron.add_argument("--neuron-compiled-path", default=None, help="root directory for compiled artifacts (default ~/.cache/disagg/neuron)")


def add_generate_parser(sub) -> None:
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


def add_bench_parser(sub) -> None:
    from disagg.cli.flags import add_speculation_flags

    bench = sub.add_parser("bench", help="load-test the public API and report latency, throughput and goodput")
    bench.add_argument("--address", default="127.0.0.1:50050", help="our gRPC API (--api grpc)")
    bench.add_argument("--api", default="grpc", choices=["grpc", "openai"],
                       help="openai: stream /v1/completions of any OpenAI-compatible server (ours with "
                            "--http-port, vLLM, ...); needs pip install 'disagg[bench]'")
    bench.add_argument("--url", default=None, help="base URL of the OpenAI API (--api openai), e.g. http://127.0.0.1:8000")
    bench.add_argument("--start-cluster", action="store_true", help="start a local cluster on --model (or the default model) to test")
    bench.add_argument("--model", default=None)
    bench.add_argument("--log-dir", default=None)
    bench.add_argument("--requests", type=int, default=100, help="measured requests per run")
    bench.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals at this many requests/s")
    bench.add_argument("--sweep", default=None, help="open loop over several rates, e.g. 1,2,4,8")
    bench.add_argument("--concurrency", type=int, default=8, help="closed loop (when no rate): users each sending one request after another")
    bench.add_argument("--prompt-len", default="32", help="tokens: a number or a range low:high")
    bench.add_argument("--output-len", default="32", help="tokens: a number or a range low:high")
    bench.add_argument("--dataset", default=None, help="JSONL prompts: ShareGPT conversations or {prompt, output_len}")
    bench.add_argument("--warmup", type=int, default=4, help="requests sent first and not counted")
    bench.add_argument("--duration", type=float, default=None, help="cap each open-loop run at about this many seconds")
    bench.add_argument("--ttft-target", type=float, default=500, help="goodput target for time to first token, ms")
    bench.add_argument("--itl-target", type=float, default=50, help="goodput target for inter-token latency, ms")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--json", default=None, help="write the results here")
    bench.add_argument("--plot", default=None, help="write PNG plots with this path prefix (needs matplotlib: pip install 'disagg[bench]')")
    bench.add_argument("--no-progress", action="store_true")
    bench.add_argument("--metrics", action="append", default=[], metavar="HOST:PORT",
                       help="a decode worker's Prometheus metrics (its --metrics-port), read before and after each run: the report adds what "
                            "its speculative steps did (guesses proposed, accepted, tokens emitted per step; acceptance by position). "
                            "Repeat for each decode worker (default with --start-cluster: its decode workers)")
    add_speculation_flags(bench.add_argument_group("--start-cluster: speculative decoding on its workers (docs/speculation.md)"))
    bench.set_defaults(run=cmd_bench)


def add_make_model_parser(sub) -> None:
    make = sub.add_parser("make-model", help="make a small trained checkpoint offline")
    make.add_argument("out")
    make.add_argument("--architecture", default="llama",
                      help="a transformers model type served exactly (docs/models.md): llama, qwen2, mistral, gemma2, gptj, bloom, ...")
    make.add_argument("--train-steps", type=int, default=300)
    make.set_defaults(run=cmd_make_model)


if __name__ == "__main__":
    sys.exit(main())
