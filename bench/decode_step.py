"""The decode step in one process: its variants side by side, against the roofline.

For each batch size, the median time of one `TorchBackend.decode_step` (the
model over the slots, then greedy sampling) with every row at `--context`
positions, for each of `--variants`, measured interleaved: `eager`
(transformers' linears, MKL), `native` (the CPU default for Llama, Mistral
and Qwen2 in float32: the whole step in one call into `native_step.c`, over
the prepacked weights, mapped from the box's packed weights file), `native-unshared` (the same over weights in
the process's own memory, `--no-share-weights`), `native-1core` (the same on one core), `prepacked`
(the step through transformers' modules with `packed_linear`'s weights and,
float32 on one thread, `small_gemm`'s kernel for up to 64 rows: every product
of up to 64 rows on two cores, the helper at the lowest priority; the default
before 2026-11-24 and still for other models), `prepacked-1core` (the same on one core),
`prepacked-single-shared` (only single rows on two cores, the default before
2026-11-24), `prepacked-shared` (the same as `prepacked`, kept for older
commands),
`prepacked-ungrouped` (the same with every linear its own product: q, k
and v, and gate and up, are otherwise one product each),
`prepacked-onednn` (the same without the kernel: oneDNN, and MKL for one row),
`prepacked-gathered` (the same with the decode attention over rows gathered
from the cache, or a view of it, and PyTorch's SDPA: `slot_attention` reads
each row's slot in place otherwise), `compiled` (buckets; CUDA graphs on CUDA).
With `--scattered` the rows are every other slot, as under load, where the
slots are not one contiguous run. The roofline is the weights' bytes over the memory read
bandwidth measured here (a sum over a buffer larger than the caches, on the
same threads), the least time a batch-1 step can take; the weights are
every parameter but the input embedding table, of which a step reads a row.
An 8-bit variant's own roofline (its bytes as served; a float32 model's too where its
weights are held in bf16, disagg/engine/weight_storage.py) is taken over two cores'
bandwidth sampled every few rounds among that batch's steps (the line ends with
it): on a shared host the bandwidth moves between runs of a minute.

    python bench/decode_step.py                       # SmolLM-135M shape, bf16, CPU
    python bench/decode_step.py --shape llama-3.2-1b --batch 1,8,32 --variants native --scattered
    python bench/decode_step.py --dtype float32 --batch 1,8,32,64
    python bench/decode_step.py --device cuda --variants eager,compiled
    python bench/decode_step.py --dtype float32 --variants prepacked-onednn,prepacked
    python bench/decode_step.py --dtype float32 --batch 1 --variants prepacked-1core,prepacked
    python bench/decode_step.py --dtype float32 --batch 1,8 --variants prepacked-ungrouped,prepacked
    python bench/decode_step.py --dtype float32 --batch 2,8,16 --variants prepacked,prepacked-shared
    python bench/decode_step.py --dtype float32 --batch 1,8,16,32 --variants prepacked-gathered,prepacked --scattered
    python bench/decode_step.py --dtype float32 --batch 1,8,16,32,64 --variants prepacked,native --scattered
    python bench/decode_step.py --batch 1,8,32 --variants prepacked,prepacked-paged --scattered   # the paged KV cache
    python bench/decode_step.py --batch 1,8,32 --variants native,native-int8,native-fp8 --scattered   # 8-bit weights
    python bench/decode_step.py --batch 1,8,32 --variants native,native-int8,native-w8a8 --scattered   # W8A8 too
    python bench/decode_step.py --batch 1 --variants native-int8,native-int8-head   # the LM head in int8 too (--quantization-skip "")
    python bench/decode_step.py --batch 1,8,32 --variants native-int8@dot,native-int8@vnni   # int8 kernels named (DISAGG_INT8_KERNEL)
    python bench/decode_step.py --dtype float32 --batch 1,8,32 --variants native,native-w8a8@vnni,native-w8a8@avx2   # W8A8's builds (DISAGG_W8A8_KERNEL)
    python bench/decode_step.py --dtype float32 --batch 1,8,32 --variants native@float32,native   # float32 weights held in float32, or in bf16
    python bench/decode_step.py --batch 1,8 --context 1024 --variants native-paged,native-kv-int8,native-kv-fp8   # an 8-bit KV cache
    python bench/decode_step.py --batch 1,8 --context 1024 --variants native --kv-cache-dtype int8   # every variant's KV in 8 bits

A variant named with `-kv-int8` or `-kv-fp8` (or every variant, with `--kv-cache-dtype`) keeps its
KV cache in 8 bits (codes and a scale per block of 16 positions and head), paged as `-paged`.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])

from disagg.engine.backends import torch_backend  # noqa: E402
from disagg.engine.backends.base import StepInputs  # noqa: E402
from disagg.engine.backends.torch_backend import TorchBackend, TorchBackendConfig  # noqa: E402
from disagg.engine.cpu_kernels import small_gemm  # noqa: E402
from disagg.engine.quantization.kv_cache import KV_CACHE_DTYPES  # noqa: E402
from disagg.tools.tinymodel import BENCH_SHAPES, ensure_tiny_model  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def read_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes per second a sum reads, over a buffer far larger than the caches."""
    buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    times = []
    for _ in range(5):
        sync(device)
        started = time.perf_counter()
        buffer.sum()
        sync(device)
        times.append(time.perf_counter() - started)
    return nbytes / min(times)


PEAK_SOURCE = pathlib.Path(__file__).resolve().parent / "kernels" / "fma_peak.c"


def fma_peak(dtype: str) -> dict[int, float] | None:
    """FLOP/s of the instruction this host's products of `dtype` weights multiply with (VDPBF16PS for bf16 on
    an AVX512_BF16 CPU, else float32 FMAs in the widest vectors), on 1 and 2 threads at once (kernels/fma_peak.c):
    the ceiling a batched step's products are held against. None where it cannot be built here."""
    from disagg.engine.dtype_choice import cpu_flags

    library = small_gemm.load_library(PEAK_SOURCE, ("-O2", "-pthread", "-shared", "-fPIC"), (), "the FMA peak")
    if library is None:
        return None
    flags = cpu_flags()
    name = "fma_peak_bf16" if dtype == "bfloat16" and "avx512_bf16" in flags else "fma_peak_f32_512" if "avx512f" in flags else "fma_peak_f32"
    function = getattr(library, name)
    function.argtypes, function.restype = [ctypes.c_int, ctypes.c_long], ctypes.c_double
    peaks = {}
    for threads in (1, 2):
        best = 0.0
        for _ in range(3):
            started = time.perf_counter()
            flops = function(threads, 2_000_000)
            best = max(best, flops / (time.perf_counter() - started))
        peaks[threads] = best
    print(f"FMA peak ({name}): {peaks[1] / 1e9:.0f} GFLOP/s on one thread, {peaks[2] / 1e9:.0f} on two")
    return peaks


def step_weight_bytes(path: str, dtype: str) -> int:
    """The weights one step reads: every parameter but the input embedding table,
    of which a step reads one row per sequence (unless it is tied to the LM head)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    tied = output is not None and output.weight.data_ptr() == embedding.data_ptr()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total if tied else total - embedding.numel() * embedding.element_size()


def served_weight_bytes(backend: TorchBackend) -> int:
    """The bytes a one-row step reads from the weights as the backend serves them: every packed
    linear's panels (8-bit ones with their scales) and every other parameter but the input embedding."""
    from disagg.engine.cpu_kernels.packed_linear import PackedLinear

    model = backend.model
    embedding = model.get_input_embeddings().weight
    total = 0
    for module in model.modules():
        if isinstance(module, PackedLinear):
            total += sum(t.numel() * t.element_size() for t in (module.panels, module.onednn, module.bias) if t is not None)
        else:
            total += sum(p.numel() * p.element_size() for p in module.parameters(recurse=False) if p is not embedding)
    return total


def step_inputs(batch: int, context: int, vocab: int, device: torch.device, scattered: bool = False) -> StepInputs:
    return StepInputs(
        slots=torch.arange(batch) * (2 if scattered else 1),
        positions=torch.full((batch,), context - 1),
        input_ids=torch.randint(0, vocab, (batch,), device=device),
        params=torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]] * batch),  # greedy
        greedy=True,  # as the decode loop marks a step of greedy rows
        seeds=torch.zeros(batch, dtype=torch.long),
        steps=torch.zeros(batch, dtype=torch.long),
        kv_len=context,
        contiguous_from=None if scattered and batch > 1 else 0,
        min_position=context - 1,
    )


def step_kernels(backend: TorchBackend) -> set:
    """Every few-row kernel the backend's step may call: each build is a library with a helper thread of its
    own, and the native step asks its model dtype's kernel whether to share (8-bit weights' products too)."""
    kernels = {small_gemm.kernel(torch.float32), small_gemm.kernel(backend.dtype) if backend.dtype != torch.float32 else None}
    kernels |= {small_gemm.kernel(panels.dtype) for module in backend.model.modules() if (panels := getattr(module, "panels", None)) is not None}
    return {k for k in kernels if isinstance(k, small_gemm.SmallGemm)}


def time_step(backend: TorchBackend, inputs: StepInputs, device: torch.device, one_core: bool = False, shared_rows: int = small_gemm.SPLIT_MAX_ROWS) -> float:
    for kernel in step_kernels(backend):  # -1core: on the calling thread's core alone
        kernel.split_here(not one_core)
    small_gemm.SPLIT_MAX_ROWS = shared_rows
    sync(device)
    started = time.perf_counter()
    backend.decode_step(inputs).token_ids.tolist()  # the host reads the tokens, as the decode loop does
    return time.perf_counter() - started


@contextlib.contextmanager
def few_row_kernel(enabled: bool):
    """While a backend is built: PackedLinear takes small_gemm's kernel only if enabled."""
    saved = small_gemm.kernel
    if not enabled:
        small_gemm.kernel = lambda *_: None  # whatever dtype is asked for
    try:
        yield
    finally:
        small_gemm.kernel = saved


@contextlib.contextmanager
def linear_groups(enabled: bool):
    """While a backend is built: linears on the same input become one product only if enabled."""
    saved = torch_backend.group_shared_inputs
    if not enabled:
        torch_backend.group_shared_inputs = lambda model, run: 0
    try:
        yield
    finally:
        torch_backend.group_shared_inputs = saved


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shape", default="smollm-135m", choices=sorted(BENCH_SHAPES), help="the model's shape (seeded weights)")
    parser.add_argument("--batch", default="1,8,32,64")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variants", default="eager,prepacked,compiled")
    parser.add_argument("--batch-buckets", default="", help="compiled variants' batch buckets (default: the engine's); must end at the largest --batch")
    parser.add_argument("--scattered", action="store_true", help="rows in every other slot (not one contiguous run)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None, help="every variant's KV cache in 8 bits (paged)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.scattered and any(name.startswith("compiled") for name in args.variants.split(",")):
        parser.error("--scattered: the compiled step's rows are its first slots (a bucket), never scattered")
    return args


def variant_options() -> dict[str, dict]:
    """Each variant's TorchBackendConfig options (what differs beyond them is set in build_backends and time_step)."""
    through_modules = dict(compile=False, prepack=True, native_step=False)
    return {
        "eager": dict(compile=False, prepack=False),
        **{
            name: through_modules
            for name in (
                "prepacked", "prepacked-onednn", "prepacked-1core", "prepacked-ungrouped",
                "prepacked-shared", "prepacked-single-shared", "prepacked-gathered",
            )
        },
        "native": dict(compile=False, prepack=True),
        "native-1core": dict(compile=False, prepack=True),
        "native-unshared": dict(compile=False, prepack=True, share_weights=False),
        # 8-bit weights (--quantization), quantized at load; the LM head stays in --dtype.
        "native-int8": dict(compile=False, prepack=True, quantization="int8"),
        "native-fp8": dict(compile=False, prepack=True, quantization="fp8"),
        # W8A8 (--quantization w8a8_int8): int8 weights, each input row int8 per row (small_gemm.c's ACT_INT8 builds).
        "native-w8a8": dict(compile=False, prepack=True, quantization="w8a8_int8"),
        # The same with the LM head in int8 too (--quantization-skip ""): one 8-bit kernel for the whole step.
        "native-int8-head": dict(compile=False, prepack=True, quantization="int8", quantization_skip=()),
        "compiled": dict(compile=True, prepack=False),
        "compiled-prepacked": dict(compile=True, prepack=True),
    }


# A variant's name ending "@vnni", "@dot" or "@widen" (native-int8@vnni): its int8 products through the kernel
# DISAGG_INT8_KERNEL names, whichever the host's measured choice is; a W8A8 variant's "@vnni" or "@avx2"
# (native-w8a8@avx2): DISAGG_W8A8_KERNEL's. Its backend is built with that choice alone (a native step keeps the
# builds it was made with).
INT8_KERNELS = ("vnni", "dot", "widen")
W8A8_KERNELS = ("vnni", "avxvnni", "avx2")
# A float32 variant's "@float32" or "@bf16" (native@float32): its weights held as DISAGG_F32_WEIGHTS says
# (weight_storage: bf16 where every weight is a bf16 number, the default; float32 always).
WEIGHT_STORAGES = ("bf16", "float32")


def int8_kernel(name: str) -> tuple[str, str] | None:
    """(the variable, the kernel it names) for a variant named with "@", else None."""
    if "@" not in name:
        return None
    base, _, kernel = name.partition("@")
    if kernel in WEIGHT_STORAGES:
        return "DISAGG_F32_WEIGHTS", kernel
    variable, kernels = ("DISAGG_W8A8_KERNEL", W8A8_KERNELS) if base.startswith("native-w8a8") else ("DISAGG_INT8_KERNEL", INT8_KERNELS)
    if kernel not in kernels:
        raise SystemExit(f"{name}: the kernel after @ is one of {', '.join(kernels)}")
    return variable, kernel


def clear_kernel_choices() -> None:
    for cached in (small_gemm._int8_kernel, small_gemm._w8a8_kernel, small_gemm._kernel):
        cached.cache_clear()


@contextlib.contextmanager
def int8_kernel_named(named: tuple[str, str] | None):
    """While a backend is built: its 8-bit products through this kernel (None: the host's choice)."""
    if named is None:
        yield
        return
    variable, kernel = named
    saved = os.environ.get(variable)
    os.environ[variable] = kernel
    clear_kernel_choices()
    try:
        yield
    finally:
        os.environ.pop(variable) if saved is None else os.environ.__setitem__(variable, saved)
        clear_kernel_choices()


PAGED = "-paged"  # a variant's name with this suffix: its KV in blocks of BLOCK_SIZE, each slot's table scattered
BLOCK_SIZE = 16  # the 8-bit cache's scale blocks too (TorchBackendConfig.kv_block_size's default)
# A variant's name with one of these suffixes: its KV cache in 8 bits (paged, as it must be).
KV_SUFFIXES = {"-kv-int8": "int8", "-kv-fp8": "fp8"}


def kv_cache_dtype(args, name: str) -> str | None:
    """The variant's 8-bit KV dtype: its name's suffix, else --kv-cache-dtype (None: the model's dtype)."""
    return next((kv for suffix, kv in KV_SUFFIXES.items() if name.partition("@")[0].endswith(suffix)), args.kv_cache_dtype)


def base_variant(name: str) -> str:
    """The variant's options' name: its name without the int8 kernel, the paged or the 8-bit KV suffix."""
    name = name.partition("@")[0]
    for suffix in KV_SUFFIXES:
        name = name.removesuffix(suffix)
    return name.removesuffix(PAGED)


def random_kv(backend: TorchBackend) -> None:
    """Random K/V in every block: normal values, or 8-bit codes over the format's range with scales near the values'."""
    cache = backend.cache
    if not cache.quantized:
        for tensor in (*cache.keys, *cache.values):
            tensor.normal_()
        return
    for codes in (*cache.keys, *cache.values):
        codes.copy_(torch.randn(codes.shape).mul_(40).clamp_(-127, 127).round_())
    for scales in (*cache.key_scales, *cache.value_scales):
        scales.uniform_(0.0, 1 / 40)


def allocate_paged(backend: TorchBackend, slots: int) -> None:
    """The KV in blocks, each slot's blocks interleaved with the others' (as tables end up under load)."""
    width = -(-backend.info.max_seq_len // BLOCK_SIZE)
    backend.allocate_slots(slots, num_blocks=slots * width + 1, block_size=BLOCK_SIZE)
    for slot in range(slots):
        backend.set_block_table(slot, [1 + slot + slots * i for i in range(width)])


def build_backends(args, names: list[str], path: str, batches: list[int]) -> dict[str, TorchBackend]:
    options = variant_options()
    buckets = tuple(int(b) for b in args.batch_buckets.split(",")) if args.batch_buckets else ()
    backends = {}
    for name in names:
        kv = kv_cache_dtype(args, name)
        config = TorchBackendConfig(
            model=path, dtype=args.dtype, device=args.device, max_seq_len=max(2 * args.context, 256), batch_buckets=buckets, kv_cache_dtype=kv,
            **options[base_variant(name)],
        )
        with few_row_kernel(name != "prepacked-onednn"), linear_groups(name != "prepacked-ungrouped"), int8_kernel_named(int8_kernel(name)):
            backend = backends[name] = TorchBackend(config)
        started = time.perf_counter()
        slots = max(batches) * (2 if args.scattered else 1)
        if name.endswith(PAGED) or kv is not None:
            allocate_paged(backend, slots)
        else:
            backend.allocate_slots(slots)  # compiled: buckets from --batch-buckets
        if name == "prepacked-gathered":
            backend.reads_in_place = False
        print(f"{name}: slots ready in {time.perf_counter() - started:.1f}s ({'native' if backend.native else 'modules'} decode step)", flush=True)
        random_kv(backend)
    return backends


def roofline_result(args, device: torch.device, path: str) -> tuple[float, dict]:
    """The roofline (the weights' bytes over the read bandwidth measured here, seconds) and the run's facts."""
    weight_bytes = step_weight_bytes(path, args.dtype)
    bandwidth = read_bandwidth(device)
    roofline = weight_bytes / bandwidth
    result = {
        "device": args.device, "dtype": args.dtype, "threads": args.threads, "context": args.context, "scattered": args.scattered,
        "weight_bytes": weight_bytes, "read_bandwidth_gbs": bandwidth / 1e9, "roofline_ms": roofline * 1e3, "steps": {},
    }
    print(f"weights {weight_bytes / 1e6:.0f} MB, read bandwidth {bandwidth / 1e9:.1f} GB/s: roofline {roofline * 1e3:.2f} ms per step")
    if splits_rows(args, device):
        # small_gemm computes a single row on two cores: its roofline is what two cores read.
        two_cores = two_core_bandwidth(device)
        result["read_bandwidth_two_cores_gbs"] = two_cores / 1e9
        print(f"two cores read {two_cores / 1e9:.1f} GB/s: a one-row step split across them has a roofline of "
              f"{weight_bytes / two_cores * 1e3:.2f} ms")
    return roofline, result


def splits_rows(args, device: torch.device) -> bool:
    """Whether the steps' products run on two cores (small_gemm's helper beside one torch thread)."""
    return device.type == "cpu" and args.threads == 1 and len(os.sched_getaffinity(0)) > 1


def two_core_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    torch.set_num_threads(2)
    try:
        return read_bandwidth(device, nbytes)
    finally:
        torch.set_num_threads(1)


# While a batch is measured, two cores' read bandwidth is sampled this often (in rounds of the variants):
# on a shared host it moves by up to 1.8x from one minute to the next, so a roofline from one sample taken
# before the steps can be far from the bandwidth the steps had.
BANDWIDTH_EVERY = 3


def measure_batch(args, backends: dict[str, TorchBackend], batch: int, vocab: int, device: torch.device) -> tuple[dict[str, float], float | None]:
    """Each variant's median step time at this batch, the variants interleaved; and the median of two cores'
    read bandwidth sampled among them (None where the steps do not split their rows)."""
    inputs = step_inputs(batch, args.context, vocab, device, args.scattered)
    times = {name: [] for name in backends}
    samples = []
    for name, backend in backends.items():
        time_step(backend, inputs, device)  # warm
    for round_ in range(args.repeats):
        if splits_rows(args, device) and round_ % BANDWIDTH_EVERY == 0:
            samples.append(two_core_bandwidth(device, 1 << 29))
            for backend in backends.values():  # untimed: torch's second thread still spins after the sum, on the helper's core
                time_step(backend, inputs, device)
        for name, backend in backends.items():
            times[name].append(time_step(
                backend, inputs, device, one_core=name.endswith("-1core"), shared_rows=1 if name == "prepacked-single-shared" else 64
            ))
    return {name: statistics.median(times[name]) for name in backends}, statistics.median(samples) if samples else None


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")  # the compile's progress
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    batches = [int(b) for b in args.batch.split(",")]
    path = str(ensure_tiny_model(BENCH_SHAPES[args.shape]))
    names = args.variants.split(",")
    backends = build_backends(args, names, path, batches)
    roofline, result = roofline_result(args, device, path)
    vocab = backends[names[0]].info.vocab_size
    baseline = names[0]
    # An 8-bit variant, or a float32 one holding bf16 numbers in bf16 (weight_storage), reads fewer bytes: its own
    # roofline, over the bandwidth its step's cores read.
    bandwidth = result.get("read_bandwidth_two_cores_gbs", result["read_bandwidth_gbs"]) * 1e9
    rooflines = {name: served_weight_bytes(backend) / bandwidth for name, backend in backends.items()
                 if backend.quantization_note or backend.weight_storage is not None}
    for name, seconds in rooflines.items():
        print(f"{name}: weights {served_weight_bytes(backends[name]) / 1e6:.0f} MB as served: roofline {seconds * 1e3:.2f} ms per step")
        result[f"{name}_roofline_ms"] = seconds * 1e3
    peaks = fma_peak(args.dtype) if device.type == "cpu" else None
    if peaks:
        result["fma_peak_gflops"] = {threads: flops / 1e9 for threads, flops in peaks.items()}
    # A row's products: two FLOPs per weight (the roofline's weights, in this dtype's elements).
    flops_per_row = 2 * result["weight_bytes"] / torch.empty(0, dtype=getattr(torch, args.dtype)).element_size()
    for batch in batches:
        medians, during = measure_batch(args, backends, batch, vocab, device)
        result["steps"][batch] = {f"{name}_ms": median * 1e3 for name, median in medians.items()}
        # An 8-bit variant's own roofline over the bandwidth sampled among its steps, where there is one.
        own = {name: seconds * bandwidth / during for name, seconds in rooflines.items()} if during else rooflines
        if during:
            result["steps"][batch]["read_bandwidth_two_cores_gbs_during"] = during / 1e9
        cells = [
            f"{name} {median * 1e3:8.2f} ms ({medians[baseline] / median:4.2f}x faster, {median / roofline:4.2f}x roofline"
            + (f", {median / own[name]:4.2f}x its own" if name in own else "")
            + (f", {flops_per_row * batch / median / peaks[1 if name.endswith('-1core') else 2]:4.0%} of the peak" if peaks and batch > 1 else "") + ")"
            for name, median in medians.items()
        ]
        print(f"batch {batch:3d}: " + "   ".join(cells) + (f"   [two cores read {during / 1e9:.1f} GB/s among these steps]" if during else ""), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
