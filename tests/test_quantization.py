"""8-bit weights (disagg/engine/quantization, small_gemm.c's int8 and fp8 builds): NxDI's numbers,
the kernels against the dequantized weights, and the whole service against transformers
generate() run on the dequantized checkpoint (the numbers the kernels multiply)."""

from __future__ import annotations

import asyncio
import functools
import math

import pytest
import torch
from conftest import DEFAULT_TRANSPORT, TEST_MODELS, Reference, assert_nothing_held, kv_bytes_received, start_cluster, tiny_model
from test_prefix_cache_e2e import decode_metric

from disagg.clients.grpc_client import AsyncClient, Client
from disagg.engine.cpu_kernels import small_gemm
from disagg.engine.cpu_kernels.packed_linear import PackedLinear
from disagg.engine.quantization import QuantizationSettings, quantize, quantize_model
from disagg.tools.tinymodel import paragraphs

needs_kernel = pytest.mark.skipif(small_gemm.kernel(torch.int8) is None, reason="no AVX2 CPU or C compiler: the 8-bit kernels are not built here")
VALUE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


# -- the numbers --------------------------------------------------------------------------------------


def test_per_channel_int8_is_nxdis_observer_and_torchs_rounding():
    weight = torch.randn(48, 40, generator=torch.Generator().manual_seed(0))
    weight[3] = 0.0  # an all-zero row: NxD's observer floors its scale at float32's eps
    q = quantize(weight, "int8", "per_channel")
    # PerChannelAbsMaxObserver: scale = max(amax / quant_max, eps); torch.quantize_per_channel rounds half to even.
    scale = torch.clamp(weight.abs().amax(dim=1) / 127, min=torch.finfo(torch.float32).eps)
    expected = torch.quantize_per_channel(weight, scale.double(), torch.zeros(48, dtype=torch.long), 0, torch.qint8).int_repr()
    assert torch.equal(q.values, expected) and torch.equal(q.scale, scale)
    assert int(q.values.abs().max()) == 127


def test_per_tensor_int8_is_torchs_min_max_observer():
    from torch.ao.quantization.observer import MinMaxObserver

    weight = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    q = quantize(weight, "int8", "per_tensor")
    observer = MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
    observer(weight)
    scale, zero = observer.calculate_qparams()
    expected = torch.quantize_per_tensor(weight, float(scale), int(zero), torch.qint8).int_repr()
    assert torch.equal(q.values, expected) and bool((q.scale == float(scale)).all())


def test_fp8_values_are_the_casts_of_the_scaled_rows():
    weight = torch.randn(24, 64, generator=torch.Generator().manual_seed(2))
    q = quantize(weight, "fp8")
    assert q.values.dtype == torch.float8_e4m3fn and torch.equal(q.scale, torch.clamp(weight.abs().amax(dim=1) / 448, min=1e-5))
    assert torch.equal(q.values.float(), (weight / q.scale[:, None]).to(torch.float8_e4m3fn).float())


# -- the kernels ---------------------------------------------------------------------------------------


# Each 8-bit build this host runs (a test forces each): weights widened to float32 (AVX2, and AVX-512VL's
# blocks of 4 rows), int8 or fp8 widened to bf16 for VDPBF16PS (bf16 rows: a bf16 model's), and int8 through
# VPDPBUSD over the rows as exact integers (float32 rows, and bf16 rows).
BUILDS = [
    name for name in ("int8", "int8-avx512", "fp8", "fp8-avx512", "int8-dot", "fp8-dot", "int8-vnni", "int8-vnni-bf16")
    if small_gemm.build_kernel(name) is not None
]


@needs_kernel
@pytest.mark.parametrize("build", BUILDS)
def test_the_kernel_multiplies_the_dequantized_weight(build):
    kernel = small_gemm.build_kernel(build)
    method = "fp8" if build.startswith("fp8") else "int8"
    generator = torch.Generator().manual_seed(3)
    for out_features, in_features in ((50, 300), (24, 8), (97, 576)):  # a partial panel, one panel, several chunks of K
        q = quantize(torch.randn(out_features, in_features, generator=generator), method)
        panels = kernel.pack_quantized(q.values, q.scale)
        values, scale = kernel.unpack_quantized(panels, out_features, in_features)
        assert torch.equal(values.view(torch.uint8), q.values.view(torch.uint8)) and torch.equal(scale, q.scale)
        assert panels.dtype == kernel.weight_dtype
        bias = torch.randn(out_features, generator=generator)
        for rows in (1, 2, 3, 4, 5, 64, 65):
            x = torch.randn(rows, in_features, generator=generator)
            x = x.bfloat16().float() if kernel.bf16_rows else x  # the dot builds' rows are a bf16 model's
            expected = x.double() @ q.dequantized().double().T + bias.double()
            got = kernel.product(x, panels, out_features, bias).double()
            assert (got - expected).abs().max() <= 1e-5 * expected.abs().max(), (out_features, in_features, rows)


@needs_kernel
@pytest.mark.parametrize("build", [name for name in BUILDS if name.startswith("fp8")])
def test_every_fp8_code_is_read_as_its_value(build):
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # all but NaN
    values = codes.view(torch.float8_e4m3fn).reshape(-1, 1)
    kernel = small_gemm.build_kernel(build)
    out = kernel.product(torch.ones(1, 1), kernel.pack_quantized(values, torch.ones(len(codes))), len(codes), None)
    assert torch.equal(out[0], values[:, 0].float())


@needs_kernel
def test_a_row_gives_the_same_bits_alone_and_in_a_batch():
    """Every build sums a row in one order whatever the batch's rows (seeded sampling stays batch-invariant)."""
    generator = torch.Generator().manual_seed(4)
    for build in BUILDS:
        kernel = small_gemm.build_kernel(build)
        q = quantize(torch.randn(72, 600, generator=generator), "fp8" if build.startswith("fp8") else "int8")
        panels = kernel.pack_quantized(q.values, q.scale)
        rows = torch.randn(20, 600, generator=generator).bfloat16().float()  # 20: past int8-dot's two blocks, where it widens a chunk once
        together = kernel.product(rows, panels, 72, None)
        assert all(torch.equal(kernel.product(rows[i : i + 1], panels, 72, None)[0], together[i]) for i in range(20)), build


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_a_packed_8_bit_linear_is_the_dequantized_linear_for_a_decode_step_and_a_prefill(dtype, method):
    """A decode step's rows (the kernel), a prefill's (in blocks of 64) and a long one's (oneDNN over the
    layout derived from the panels) all multiply the dequantized weight."""
    from disagg.engine.cpu_kernels.packed_linear import DERIVED_MIN_ROWS, can_prepack

    if not can_prepack(torch.device("cpu"), dtype):
        pytest.skip(f"oneDNN does not pack {dtype} here")
    generator = torch.Generator().manual_seed(5)
    linear = torch.nn.Linear(96, 72, bias=True).to(dtype)
    q = quantize(linear.weight, method)
    with torch.no_grad():
        linear.weight.copy_(q.dequantized(dtype))
    packed = PackedLinear(linear, quantized=q)
    assert packed.panels.dtype in small_gemm.QUANTIZED_DTYPES
    for rows in (1, 7, 65, DERIVED_MIN_ROWS):
        x = torch.randn(rows, 96, generator=generator).to(dtype)
        expected = torch.nn.functional.linear(x.float(), q.dequantized(), linear.bias.float())
        got = packed(x).float()
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: one rounding of the output, and of the derived weight
        assert (got - expected).abs().max() <= tolerance * expected.abs().max(), (rows, dtype, method)


VNNI_BUILDS = [name for name in ("int8-vnni", "int8-vnni-bf16") if name in BUILDS]


@pytest.mark.skipif(not VNNI_BUILDS, reason="no AVX512_VNNI CPU: the int8-vnni builds do not run here")
@pytest.mark.parametrize("build", VNNI_BUILDS)
def test_the_vnni_builds_sums_are_exact_integers(build):
    """int8-vnni takes each row as an integer times a power of two: integer rows (bf16-exact, within 14 binades of
    the row's largest) times int8 weights with unit scales give the integer products exactly, however the values
    span (a row's largest value sets its power; values 2^-8 of it and negative ones keep every bit); a row of
    zeros gives zeros, a row holding an infinity or a NaN gives NaN as float32 products would."""
    kernel = small_gemm.build_kernel(build)
    generator = torch.Generator().manual_seed(6)
    out_features, in_features = 50, 600  # a partial panel; three chunks of K, the last partial
    values = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, generator=generator)
    panels = kernel.pack_quantized(values, torch.ones(out_features))
    big = torch.randint(-255, 256, (3, in_features), generator=generator) * 2.0**12  # 8 bits at 2^12..2^20
    small = torch.randint(-255, 256, (3, in_features), generator=generator) * 2.0**4  # 8 bits at 2^4..2^12
    rows = torch.cat([big, small, torch.where(torch.arange(in_features) % 2 == 0, big[:1], small[:1])])
    expected = rows.double() @ values.double().T  # every sum below 2^53: exact in double
    got = kernel.product(rows, panels, out_features, None).double()
    assert (got - expected).abs().max() <= 2**-22 * expected.abs().max()  # float32's rounding of the joined planes alone
    zero = kernel.product(torch.zeros(1, in_features), panels, out_features, None)
    assert torch.equal(zero, torch.zeros(1, out_features))
    for bad in (float("inf"), float("nan")):
        row = torch.ones(1, in_features)
        row[0, 7] = bad
        assert kernel.product(row, panels, out_features, None).isnan().all()


@pytest.fixture(params=["vnni", "dot", "widen"])
def int8_kernel(request, monkeypatch):
    """Each int8 product kernel this CPU runs, named as DISAGG_INT8_KERNEL names it."""
    monkeypatch.setenv("DISAGG_INT8_KERNEL", request.param)
    small_gemm._int8_kernel.cache_clear()
    yield request.param
    small_gemm._int8_kernel.cache_clear()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_int8_kernel_serves_a_native_step_of_the_dequantized_model(int8_kernel, dtype):
    """The int8 kernel DISAGG_INT8_KERNEL names (where it runs here, for a model of this dtype) serves the
    native decode step: its logits are those of the same step over the dequantized weights in the model's
    dtype (float32 arithmetic over bf16-rounded rows for bf16, as int8-dot's), within rounding."""
    from test_native_step import native_and_reference_logits

    from disagg.engine.backends import load_backend
    from disagg.engine.cpu_kernels.packed_linear import can_prepack

    builds = {"vnni": "int8-vnni-bf16" if dtype == torch.bfloat16 else "int8-vnni", "dot": "int8-dot", "widen": "int8-avx512"}
    if small_gemm.build_kernel(builds[int8_kernel]) is None or (int8_kernel == "dot" and dtype == torch.float32):
        pytest.skip(f"{builds[int8_kernel]} does not serve {dtype} rows here")
    if not can_prepack(torch.device("cpu"), dtype):
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU: no native step")
    from transformers import AutoModelForCausalLM

    from disagg.engine.backends.torch_backend import TorchBackend, TorchBackendConfig

    quantized = load_backend("torch", model=tiny_model("llama"), dtype=str(dtype).removeprefix("torch."), quantization="int8")
    chosen = small_gemm.quantized_kernel(torch.int8, dtype)
    assert chosen is not None and chosen.name.startswith(builds[int8_kernel].removesuffix("-avx512"))
    assert any(getattr(m, "panels", None) is not None and m.panels.dtype == chosen.weight_dtype for m in quantized.model.modules())
    # The reference: transformers' modules in float32 over the dequantized values in the model's dtype.
    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=dtype).eval()
    assert quantize_model(model, QuantizationSettings("int8"))
    reference = TorchBackend(TorchBackendConfig(model=tiny_model("llama"), dtype="float32", native_step=False), model=model.float())
    quantized.allocate_slots(6), reference.allocate_slots(6)
    assert quantized.native is not None
    got, want = native_and_reference_logits(quantized, reference)
    assert (got - want).abs().max() <= (1e-4 if dtype == torch.float32 else 8e-3) * want.abs().max()


@needs_kernel
def test_8_bit_panels_take_at_most_0_55x_of_bf16s_bytes():
    linear = torch.nn.Linear(576, 1536, bias=False)
    for method in ("int8", "fp8"):
        q = quantize(linear.weight, method)
        packed = PackedLinear(linear, quantized=q)
        assert packed.panels.dtype == small_gemm.quantized_kernel(VALUE_DTYPES[method], torch.float32).weight_dtype  # this host's build's tag
        assert packed.panels.numel() * packed.panels.element_size() <= 0.55 * linear.weight.numel() * 2


def tied_checkpoint(directory) -> str:
    """The tiny Llama with its LM head tied to the embedding (as SmolLM-135M's and Llama-3.2-1B's are): the
    config says so and the file holds no lm_head.weight."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    source = tiny_model("llama")
    shutil.copytree(source, directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return str(directory)


@needs_kernel
def test_a_tied_lm_head_is_quantized_as_a_copy_of_its_own_where_the_skip_list_lets_it(tmp_path):
    """--quantization-skip '' on a tied checkpoint: the LM head gets 8-bit panels of its own (as llama.cpp's q8_0
    quantizes it), the embedding keeps the full-precision weight its lookups read, and the served logits are the
    reference's (the embedding as stored, the head's weight dequantized). With the default skip it stays tied."""
    from transformers import AutoModelForCausalLM

    from disagg.engine.backends.torch_backend import TorchBackend, TorchBackendConfig
    from disagg.engine.memory import CheckpointFacts, Quantized

    path = tied_checkpoint(tmp_path / "tied")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    embedding = model.get_input_embeddings().weight.detach().clone()
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert "lm_head" not in quantize_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), QuantizationSettings("int8"))
    weights = quantize_model(model, QuantizationSettings("int8", skip=()))
    assert torch.equal(model.lm_head.weight, weights["lm_head"].dequantized()) and not torch.equal(model.lm_head.weight, embedding)
    assert torch.equal(model.get_input_embeddings().weight, embedding)
    model.tie_weights()  # transformers' own re-tying leaves it untied: the config says it is
    assert model.lm_head.weight is not model.get_input_embeddings().weight
    backend = TorchBackend(TorchBackendConfig(model=path, dtype="float32", quantization="int8", quantization_skip=(), share_weights=False))
    head = backend.model.get_output_embeddings()
    assert isinstance(head, PackedLinear) and head.panels.dtype in small_gemm.QUANTIZED_DTYPES
    assert torch.equal(backend.model.get_input_embeddings().weight, embedding)
    prompt = [5, 17, 200, 33, 9]
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0, -1]
    got = backend.prefill_logits(prompt, lambda *kv: None)[0].float()
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()
    facts = CheckpointFacts.read(path)  # the estimate: the head's panels in one byte a value, not four
    saved = facts.weight_bytes(4, True, Quantized(head=False)) - facts.weight_bytes(4, True, Quantized(head=True))
    assert facts.tied_head_values and saved == 3 * facts.tied_head_values


# -- quality: negative log-likelihood on held-out text ------------------------------------------------



def mean_nll(model, texts: list[str], tokenizer) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([tokenizer(text)["input_ids"][:256]])
            logits = model(ids).logits[0, :-1].float()
            total += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
            count += ids.shape[1] - 1
    return total / count


def test_held_out_nll_within_1_percent_for_int8_and_3_for_fp8():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model("llama-held-out")
    tokenizer = AutoTokenizer.from_pretrained(path)
    held_out = paragraphs()[:: TEST_MODELS["llama-held-out"].held_out_every]
    plain = mean_nll(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), held_out, tokenizer)
    for method, bound in (("int8", 0.01), ("fp8", 0.03)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        assert quantize_model(model, QuantizationSettings(method))
        nll = mean_nll(model, held_out, tokenizer)
        assert nll <= plain * (1 + bound), f"{method}: {nll:.4f} against {plain:.4f} unquantized"
        assert nll != plain  # the weights did change
    # The model learned its text (far below a uniform guess there), so a quantization that broke it would show.
    trained = [text for index, text in enumerate(paragraphs()) if index % TEST_MODELS["llama-held-out"].held_out_every]
    assert mean_nll(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), trained[:20], tokenizer) < 0.5 * math.log(len(tokenizer))


# -- the whole service ----------------------------------------------------------------------------------


@functools.cache
def dequantized_reference(architecture: str, method: str) -> Reference:
    """generate() on the checkpoint with its linears (all but the LM head) set to their dequantized 8-bit values."""
    ref = Reference(tiny_model(architecture))
    assert quantize_model(ref.model, QuantizationSettings(method))
    return ref


BLOCK = 16
CONTEXT = "Every spring the school holds a fair. There are games, music, and a long table of cakes that the parents bake the night before. "
QUESTIONS = ["Who bakes the cakes?", "What is there at the fair?", "When is the fair held?"]
# (architecture, method, transport): each method on Llama over both transports, and the other architectures
# (Qwen2's biases, Mistral's sliding window; every tiny model is GQA: 4 query heads, 2 KV heads) on the default.
CASES = [
    ("llama", "int8", "grpc"), ("llama", "int8", "nixl"), ("qwen2", "fp8", DEFAULT_TRANSPORT), ("mistral-sw", "int8", DEFAULT_TRANSPORT),
]


@pytest.fixture(scope="module", params=CASES, ids=["-".join(case) for case in CASES])
def quantized_cluster(request, cluster_logs):
    architecture, method, transport = request.param
    if transport == "nixl":
        from disagg.kv_transport.nixl_transport import available

        if not available():
            pytest.skip("NIXL is not installed")
    cluster = start_cluster(cluster_logs / f"quantized-{method}", architecture, transport=transport, batch_size=8,
                            worker_args=["--quantization", method, "--block-size", str(BLOCK)])
    yield architecture, method, transport, cluster
    cluster.stop()


@needs_kernel
def test_greedy_tokens_equal_generate_on_the_dequantized_checkpoint(quantized_cluster):
    """A mixed batch of different lengths, and prompts that share whole blocks (prefix hits), served side by side."""
    architecture, method, transport, cluster = quantized_cluster
    ref = dequantized_reference(architecture, method)
    texts = paragraphs()
    cases = [(" ".join(texts[i].split()[: 3 + (i * 7) % 30]), 6 + (i * 5) % 20) for i in range(8)]
    before = kv_bytes_received(cluster, transport)
    with Client(cluster.router_address, timeout=60) as client:  # the context's blocks published first
        assert client.complete(CONTEXT + QUESTIONS[0], max_new_tokens=12).token_ids == ref.greedy(CONTEXT + QUESTIONS[0], 12)
    hits = decode_metric(cluster, "disagg_decode_prefix_hit_tokens_total")
    cases += [(CONTEXT + question, 12) for question in QUESTIONS[1:]]

    async def run():
        async with AsyncClient(cluster.router_address, timeout=120) as client:
            return await asyncio.gather(*(client.complete(prompt, max_new_tokens=n) for prompt, n in cases))

    for (prompt, n), result in zip(cases, asyncio.run(run())):
        assert result.token_ids == ref.greedy(prompt, n), prompt
    assert decode_metric(cluster, "disagg_decode_prefix_hit_tokens_total") - hits >= 2 * BLOCK * 2  # both later questions hit the context
    assert kv_bytes_received(cluster, transport) > before, f"the KV did not move through {transport}"
    assert_nothing_held(cluster)


def test_an_unknown_quantization_is_refused_by_the_flags():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "decode_worker", "--quantization", "int4"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--quantization" in result.stderr and "int4" in result.stderr
