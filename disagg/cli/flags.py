"""Command-line flags shared by the three servers, and process set-up.

Each entry point parses its flags once into its role's config dataclass.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os

from disagg.kv_transport import CHOICES as KV_CHOICES
from disagg.kv_transport import DEFAULT as KV_DEFAULT


def add_server_flags(parser: argparse.ArgumentParser, default_port: int, default_metrics_port: int) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind; localhost unless you pass --bind-all")
    parser.add_argument("--bind-all", action="store_true", help="bind to all interfaces (0.0.0.0)")
    parser.add_argument("--port", type=int, default=default_port, help=f"port to listen on (default {default_port}; 0 picks a free one)")
    parser.add_argument("--log-level", default=os.environ.get("DISAGG_LOG_LEVEL", "INFO"))
    parser.add_argument("--metrics-port", type=int, default=default_metrics_port,
                        help=f"Prometheus metrics port (default {default_metrics_port}; 0 turns them off; -1 takes a free one)")
    parser.add_argument("--port-file", default=None, help="write the bound ports here as JSON (for --port 0)")
    parser.add_argument("--grace-seconds", type=float, default=30.0, help="on SIGTERM, how long calls in flight may take to finish")
    tls = parser.add_argument_group("mutual TLS between the router and the workers")
    tls.add_argument("--tls-cert", help="this process's certificate (PEM); serves and connects with it")
    tls.add_argument("--tls-key", help="its private key (PEM)")
    tls.add_argument("--tls-ca", help="CA (PEM) that peers' certificates must be signed by")
    tls.add_argument("--tls-server-name", help="name the peers' certificates must carry, whatever address is dialled (workers found by IP through DNS)")


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="Hugging Face checkpoint: a local directory or a hub id (default: the built-in tiny model, made on first use)")
    parser.add_argument("--backend", default="torch", choices=["torch", "neuron"])
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                        help="auto: bfloat16 on a CPU with native bf16 (AVX512_BF16, AMX), float32 on others, the checkpoint's own on CUDA, bf16 on Neuron")
    parser.add_argument("--device", default="cpu", help="torch device for the torch backend (cpu, cuda)")
    parser.add_argument("--max-seq-len", type=int, default=0, help="prompt plus generated tokens (default: the model's limit, at most 4096)")
    parser.add_argument("--global-topk", type=int, default=0, help="cap sampling candidates per row, as NxDI's global_topk (0: whole vocabulary)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument(
        "--device-cpus",
        type=cpu_list,
        default=None,
        help="pin the thread that runs the model (and torch's compute threads) to these CPUs, e.g. 1 or 2-3; "
        "gRPC and KV receive stay on the process's other CPUs, as host work does beside an accelerator; "
        "pinned to one CPU, the few-row kernel no longer splits a single-row step across two cores",
    )
    parser.add_argument("--kv-transport", default=KV_DEFAULT, choices=KV_CHOICES,
                        help="how KV moves between the workers: a gRPC stream, or NIXL reading it straight into the decode slot (needs "
                             "nixl-cu12; UCX_* variables pass through); auto: NIXL where it is installed and loads, else gRPC")
    parser.add_argument("--nixl-backend", default="UCX", choices=("UCX", "LIBFABRIC"),
                        help="NIXL's transfer backend: UCX (the PyPI build's), or LIBFABRIC for EFA on "
                             "AWS (a NIXL built against /opt/amazon/efa; docs/neuron.md)")
    parser.add_argument("--status-file", default=None, help="publish the start-up phase here as JSON, rewritten every second (loading, compiling, serving): "
                        "how a launcher tells a worker compiling for minutes from one that is stuck (disagg/rpc/startup.py)")
    parser.add_argument("--token-buckets", type=bucket_list, default=None,
                        help="token-generation buckets: KV lengths a decode step is padded to, e.g. 128,512,2048; the "
                             "last must be --max-seq-len (default: powers of two from 128, as NxDI's)")
    add_quantization_flags(parser.add_argument_group("quantization"))
    add_speculation_flags(parser.add_argument_group("speculative decoding"))
    add_torch_backend_flags(parser.add_argument_group("torch backend"))
    add_neuron_backend_flags(parser.add_argument_group("neuron backend (NxD Inference)"))


def add_quantization_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--quantization", choices=("int8", "fp8", "w8a8_int8"), default=None,
                       help="quantize the linear layers' weights to 8 bits at load, as NxDI's quantized=True with quantization_dtype "
                            "int8 or f8e4m3 (weight-only: activations stay in --dtype); w8a8_int8 (SGLang's name): int8 weights, and each "
                            "linear's input rows quantized to int8 per row at run time (the CPU kernels: AVX512_VNNI, else AVX2; not on Neuron); a "
                            "pre-quantized checkpoint (compressed-tensors, NxDI's quantized state dict) is served as it is without this "
                            "flag (default: the checkpoint's own weights)")
    group.add_argument("--quantization-type", choices=("per_channel", "per_tensor"), default="per_channel",
                       help="symmetric scales per output channel or one per weight, as NxDI's quantization_type "
                            "per_channel_symmetric / per_tensor_symmetric (default: per_channel)")
    group.add_argument("--quantization-skip", type=name_list, default="lm_head",
                       help="comma-separated names: linear layers whose name contains one stay in full precision, as NxDI's "
                            "modules_to_not_convert (default: lm_head; '' quantizes every linear, a tied LM head as 8-bit panels of its "
                            "own beside the full-precision embedding)")
    group.add_argument("--kv-cache-dtype", choices=("auto", "int8", "fp8"), default="auto",
                       help="the KV cache in 8 bits, as vLLM's --kv-cache-dtype: int8 or fp8 (e4m3) codes with a float32 scale per KV "
                            "block and head, computed by the prefill and carried with the KV to the decode worker (the same --kv-cache-gib "
                            "holds about twice bf16's tokens; torch backend, paged cache); on the neuron backend fp8 is NxDI's fp8 KV cache "
                            "(kv_cache_quant: each line cast to e4m3, no scales); auto keeps it in --dtype (default: auto)")


def add_speculation_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--speculative-method", choices=("ngram", "draft", "eagle"), default=None,
                       help="speculative decoding on the decode worker, as vLLM's speculative_config method: ngram (prompt lookup: the "
                            "sequence's latest tokens found earlier in it propose what followed them there), draft (--draft-model "
                            "guesses) or eagle (an EAGLE v1 head, --draft-model, guesses from the model's own hidden states); output is "
                            "token for token what it is without it; on --backend neuron, draft and eagle (Llama models), run inside the compiled step "
                            "as NxDI's fused speculation (docs/neuron.md) (default: off)")
    group.add_argument("--draft-model", default=None,
                       help="--speculative-method draft: a smaller checkpoint with the model's tokenizer, run beside it on the decode "
                            "worker (as vLLM's speculative_config model, LMI's option.speculative_draft_model); a draft whose vocabulary "
                            "or tokenizer differs is refused at start-up. eagle: the EAGLE head's checkpoint, named as NxDI's EAGLE draft "
                            "(fc and the layers; an LM head and embeddings there are ignored: the model's serve; on --backend neuron the workers "
                            "write NxDI's draft directory from it with the model's)")
    group.add_argument("--num-speculative-tokens", type=int, default=0,
                       help="the most tokens a row guesses in one step, as vLLM's num_speculative_tokens (NxDI's speculation_length is one more: "
                            "it counts the input token's position too); "
                            "each row's count follows how many of its guesses are kept, down to none; fixed on --backend neuron (default with a method: 4)")


def name_list(text: str) -> tuple[str, ...]:
    """'lm_head,mlp.down_proj' -> ('lm_head', 'mlp.down_proj'); '' -> ()."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def add_torch_backend_flags(compiled: argparse._ArgumentGroup) -> None:
    compiled.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the decode step as one compiled graph over buckets (torch.compile, and a CUDA "
             "graph per bucket on CUDA), compiled at start-up and cached on disk; "
        "--no-compile runs it eagerly (default: compiled on CUDA, but eager there too with --speculative-method or --kv-cache-dtype: "
        "the compiled step's one slot a sequence does not serve an 8-bit cache, and its verify graph for guesses is "
        "built only with --compile given; eager on CPU, where compiling every bucket takes "
        "many minutes: docs/benchmarks.md, other figures)",
    )
    compiled.add_argument(
        "--prepack",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep each linear layer's weight in one layout made for the CPU: panels for the project's few-row kernel (float32 "
             "or bf16, built with the system's C compiler on first use), which prefills read too, or else oneDNN's packed layout: "
             "1.1-1.5x faster decode steps on this CPU than oneDNN alone; "
        "--no-prepack uses transformers' own linears (default: on CPU)",
    )
    compiled.add_argument(
        "--share-weights",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write the prepacked weights once to a file under the cache directory ($DISAGG_CACHE/packed-weights, keyed by the "
             "checkpoint's content, the dtype and the layout; CRC-checked) and map it, so that the workers on one machine hold "
             "one copy; --no-share-weights keeps them in each worker's own memory",
    )
    compiled.add_argument(
        "--native-step",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run each eager decode step, and each prefill of up to 512 tokens, of a Llama, Mistral or Qwen2 model as one call into the "
             "project's C step over the prepacked weights (float32, an AVX2 CPU), checked at start-up against transformers' own; "
        "--no-native-step runs them through transformers' modules (default: wherever it serves the model)",
    )
    compiled.add_argument("--batch-buckets", type=bucket_list, default=None,
                          help="decode batch-size buckets, e.g. 1,4,16,64; the last must be the slot count (default: powers of two up to it)")


def add_neuron_backend_flags(neuron: argparse._ArgumentGroup) -> None:
    neuron.add_argument("--tp-degree", type=int, default=None, help="tensor-parallel degree (NeuronCores)")
    neuron.add_argument("--context-buckets", type=bucket_list, default=None, help="context-encoding buckets, e.g. 128,512,2048 (default: NxDI's powers of two)")
    neuron.add_argument("--neuron-compiled-path", default=None, help="root directory for compiled artifacts (one subdirectory per configuration)")
    neuron.add_argument("--k-cache-transposed", action="store_true", default=None)
    neuron.add_argument("--worker-config", default=None,
                        help="JSON worker settings (our names or transformers-neuronx's: tp_degree, n_positions, batch_size, amp, context_length_estimate)")
    neuron.add_argument("--serving-properties", default=None, help="an LMI serving.properties to take settings from")


def bucket_list(text: str) -> tuple[int, ...]:
    """'128,512,2048' -> (128, 512, 2048)."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of sizes such as 128,512,2048") from None


def cpu_list(text: str) -> frozenset[int]:
    """'1', '0,2' or '2-3' -> CPU ids."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            low, _, high = part.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a CPU list such as 1, 0,2 or 2-3") from None
    if not cpus:
        raise argparse.ArgumentTypeError("the CPU list is empty")
    return frozenset(cpus)


def address(args) -> str:
    return f"{'0.0.0.0' if args.bind_all else args.host}:{args.port}"


def internal_tls(args):
    from disagg.rpc.security import tls_from_flags

    tls = tls_from_flags(args.tls_cert, args.tls_key, args.tls_ca, "--tls-cert/--tls-key/--tls-ca")
    if tls is not None and not tls.ca:
        raise SystemExit("--tls-ca is required with --tls-cert: internal links use mutual TLS")
    server_name = getattr(args, "tls_server_name", None)
    if server_name and tls is None:
        raise SystemExit("--tls-server-name needs --tls-cert/--tls-key/--tls-ca")
    return dataclasses.replace(tls, server_name=server_name) if server_name else tls


def neuron_settings(args) -> tuple[dict, dict]:
    """(worker overrides, neuron backend options) from the flags and any settings files;
    flags given on the command line win over files."""
    import logging

    from disagg.engine.backends.neuron.settings import read_serving_properties, read_worker_config

    merged: dict = {}
    for path, reader in ((args.serving_properties, read_serving_properties), (args.worker_config, read_worker_config)):
        if path:
            settings, notes = reader(path)
            for note in notes:
                logging.getLogger("disagg.settings").warning("%s: %s", path, note)
            merged.update(settings)
    flags = {
        "tp_degree": args.tp_degree,
        "context_buckets": args.context_buckets,
        "token_buckets": args.token_buckets,
        "compiled_root": args.neuron_compiled_path,
        "k_cache_transposed": args.k_cache_transposed,
    }
    merged.update({k: v for k, v in flags.items() if v is not None})
    worker_keys = ("model", "dtype", "max_seq_len", "batch_size", "quantization", "quantization_type", "quantization_skip", "draft_model",
                   "num_speculative_tokens", "speculative_method")
    worker = {k: merged.pop(k) for k in worker_keys if k in merged}
    optimize = merged.pop("neuron_optimize_level", None)
    if optimize is not None:
        import os

        # neuronx-cc reads its flags from the environment at compile time.
        os.environ["NEURON_CC_FLAGS"] = f"{os.environ.get('NEURON_CC_FLAGS', '')} --optlevel {optimize}".strip()
    return worker, merged


def worker_fields(args) -> tuple[dict, dict]:
    """(the WorkerConfig fields, the settings files' values) from parsed flags.
    A settings file (serving.properties, worker JSON) wins over a flag's default."""
    settings, neuron = neuron_settings(args)
    fields = dict(
        model=resolve_model(settings.get("model", args.model)),
        address=address(args),
        backend=args.backend,
        dtype=settings.get("dtype", args.dtype),
        device=args.device,
        max_seq_len=settings.get("max_seq_len", args.max_seq_len),
        global_topk=args.global_topk,
        threads=args.threads,
        device_cpus=args.device_cpus,
        grace_seconds=args.grace_seconds,
        metrics_port=args.metrics_port,
        port_file=args.port_file,
        status_file=args.status_file,
        tls=internal_tls(args),
        neuron=neuron,
        kv_transport=kv_transport(args.kv_transport),
        kv_transport_fallback=args.kv_transport == "auto",
        nixl_backend=args.nixl_backend,
        compile=args.compile,
        prepack=args.prepack,
        native_step=args.native_step,
        share_weights=args.share_weights,
        quantization=settings.get("quantization", args.quantization),
        quantization_type=settings.get("quantization_type", args.quantization_type),
        quantization_skip=tuple(settings.get("quantization_skip", args.quantization_skip)),
        kv_cache_dtype=None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype,
        # LMI's option.speculative_draft_model is a draft model's speculation (transformers-neuronx's speculative sampling);
        # NxDI's enable_fused_speculation / enable_eagle_speculation in a worker config name theirs.
        speculative_method=args.speculative_method or settings.get("speculative_method") or ("draft" if settings.get("draft_model") else None),
        num_speculative_tokens=settings.get("num_speculative_tokens", args.num_speculative_tokens),
        draft_model=settings.get("draft_model", args.draft_model),
        batch_buckets=args.batch_buckets or (),
        token_buckets=args.token_buckets or (),
    )
    return fields, settings


def kv_transport(choice: str) -> str:
    """The transport to open; refuses --kv-transport nixl up front when NIXL is not installed."""
    from disagg.kv_transport import resolve
    from disagg.kv_transport.nixl_transport import available

    if choice == "nixl" and not available():
        raise SystemExit("--kv-transport nixl: NIXL is not installed (pip install nixl-cu12, or 'disagg[nixl]')")
    return resolve(choice)


def resolve_model(model: str | None) -> str:
    if model:
        return model
    from disagg.tools.tinymodel import ensure_tiny_model

    return str(ensure_tiny_model())


def setup_process(args) -> None:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    threads = getattr(args, "threads", 0)
    if threads:
        import torch

        torch.set_num_threads(threads)


def refusals(backend: str) -> tuple[type[Exception], ...]:
    """What a worker's start-up raises for a model or setting it cannot serve exactly. Only the
    chosen backend's modules are imported: the neuron workers run under NxDI's transformers
    release, which the torch backend's modules do not import under."""
    from disagg.engine.backends.architectures import UnsupportedModel
    from disagg.kv_transport.nixl_transport import NixlUnavailable

    if backend == "neuron":
        from disagg.engine.backends.neuron.layout import UnsupportedLayout
        from disagg.engine.backends.neuron.packages import NeuronPackagesMissing, UnsupportedNxdi

        return UnsupportedModel, NixlUnavailable, UnsupportedLayout, NeuronPackagesMissing, UnsupportedNxdi
    from disagg.engine.backends.compiled import BadBuckets
    from disagg.engine.cpu_kernels.small_gemm import BadKernelSetting

    return UnsupportedModel, NixlUnavailable, BadBuckets, BadKernelSetting


MEMORY_HINTS = "lower --kv-cache-gib or --batch-size (decode), --prefix-cache-gib (prefill) or --max-seq-len, or use --dtype bfloat16"


def refuse_if_it_cannot_fit(prog: str, config) -> None:
    """Before loading anything: a worker whose weights, KV and caches would not fit in the memory the
    machine (or its cgroup) has free ends with one line saying so (exit status 2), rather than being
    killed by the kernel once it is serving. Only where they live in this machine's memory."""
    import sys

    from disagg.engine import memory

    facts = memory.CheckpointFacts.read(config.model) if memory.checks_host_memory(config.backend, config.device) else None
    if facts is None:
        return
    try:
        memory.check_fits([config.memory_need(facts)], "this worker", MEMORY_HINTS)
    except memory.NotEnoughMemory as e:
        print(f"{prog}: {e}", file=sys.stderr)
        sys.exit(2)


def run_worker(prog: str, serve, config) -> None:
    """Runs a worker's serve(config); a model or setting the engine cannot serve exactly ends
    the process with one line naming it and why (exit status 2), not a traceback."""
    import asyncio
    import sys

    from disagg.kv_transport.nixl_transport import NixlUnavailable

    refuse_if_it_cannot_fit(prog, config)
    refused = refusals(config.backend)
    try:
        asyncio.run(serve(config))
    except refused as e:
        if isinstance(e, NixlUnavailable):
            print(f"{prog}: --kv-transport nixl: {e}", file=sys.stderr)
        elif type(e).__name__ in ("BadBuckets", "BadKernelSetting"):  # a flag's or the environment's fault, not the model's
            print(f"{prog}: {e}", file=sys.stderr)
        else:
            print(f"{prog}: refusing {config.model}: {e}", file=sys.stderr)
        sys.exit(2)
