"""W8A8 (`--quantization w8a8_int8`, SGLang's scheme): int8 weights per channel, and each input row of
every quantized linear quantized to int8 per row at run time (small_gemm.c's ACT_INT8 builds, one
VPDPBUSD a product). The reference here is written out independently of the engine's code: a row's
scale is max|row| / 127 in float32 and its values round(row / scale) (half to even), times the
dequantized weight; the service's greedy tokens equal transformers generate() with that hook on
every quantized linear."""

from __future__ import annotations

import asyncio
import functools

import pytest
import torch
from conftest import TEST_MODELS, Reference, assert_nothing_held, start_cluster, tiny_model
from test_quantization import BLOCK, CONTEXT, QUESTIONS, mean_nll

from disagg.clients.grpc_client import AsyncClient, Client
from disagg.engine.cpu_kernels import small_gemm
from disagg.engine.cpu_kernels.packed_linear import PackedLinear
from disagg.engine.quantization import QuantizationSettings, quantize, quantize_model
from disagg.tools.tinymodel import paragraphs


@functools.cache
def w8a8_kernel(name: str) -> small_gemm.SmallGemm | None:
    """A W8A8 build, or None where it does not run here. An AVX-VNNI build (`w8a8-avxvnni`) on a CPU without
    AVX-VNNI but with AVX512_VNNI and AVX512VL: the same source with its VPDPBUSD in the EVEX form, the same
    instruction's arithmetic on the same 256-bit vectors, so what the build computes where it runs."""
    flags = small_gemm.cpu_flags()
    if not name.startswith("w8a8-avxvnni") or "avx_vnni" in flags:
        return small_gemm.build_kernel(name)
    if not {"avx512vl", "avx512_vnni"} <= flags:
        return None
    stand_in = tuple(flag for flag in small_gemm.BUILDS[name][1] if flag != "-mavxvnni") + ("-mavx512vl", "-mavx512vnni")
    library = small_gemm.load_library(small_gemm.SOURCE, small_gemm.FLAGS + stand_in, (), f"{name}'s EVEX stand-in not used")
    return None if library is None else small_gemm.SmallGemm(library, name)


# VPDPBUSD's builds (AVX512_VNNI CPUs), AVX-VNNI's (or its stand-in) and AVX2's (any AVX2 CPU: forced here on an AVX-512 host too).
W8A8_BUILDS = [f"w8a8-{isa}{rows}" for isa in ("vnni", "avxvnni", "avx2") for rows in ("", "-bf16") if w8a8_kernel(f"w8a8-{isa}{rows}") is not None]
# Each build that reads VPDPBUSD's panels some other way, and a build it must give the bits of.
SAME_BITS = [(name, reference) for name, reference in small_gemm.SAME_PANELS.items() if {name, reference} <= set(W8A8_BUILDS)]
SAME_BITS += [(f"w8a8-avxvnni{rows}", f"w8a8-avx2{rows}") for rows in ("", "-bf16") if {f"w8a8-avxvnni{rows}", f"w8a8-avx2{rows}"} <= set(W8A8_BUILDS)]
needs_w8a8 = pytest.mark.skipif(not W8A8_BUILDS, reason="no AVX2 CPU (or no C compiler): the W8A8 kernel does not run here")


def rows_int8(x: torch.Tensor) -> torch.Tensor:
    """The reference's activations: each row per row symmetric int8, dequantized (float32)."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.clamp(torch.round(x / safe), -128, 127) * scale


# -- the kernel -----------------------------------------------------------------------------------------


@needs_w8a8
@pytest.mark.parametrize("build", W8A8_BUILDS)
def test_the_w8a8_kernel_multiplies_the_quantized_rows_by_the_dequantized_weight(build):
    kernel = w8a8_kernel(build)
    generator = torch.Generator().manual_seed(11)
    for out_features, in_features in ((50, 300), (24, 8), (97, 576), (30, 1000)):  # a partial panel, one panel, several chunks of K
        q = quantize(torch.randn(out_features, in_features, generator=generator), "int8")
        panels = kernel.pack_quantized(q.values, q.scale)
        assert panels.dtype == kernel.weight_dtype and panels.dtype in small_gemm.W8A8_DTYPES
        bias = torch.randn(out_features, generator=generator)
        for rows in (1, 2, 3, 4, 5, 9, 64):
            x = torch.randn(rows, in_features, generator=generator) * torch.rand(rows, 1, generator=generator) * 10
            x = x.bfloat16().float() if kernel.bf16_rows else x
            expected = rows_int8(x).double() @ q.dequantized().double().T + bias.double()
            got = kernel.product(x, panels, out_features, bias).double()
            assert (got - expected).abs().max() <= 1e-5 * expected.abs().max(), (out_features, in_features, rows)
            # Not the full-precision rows' product: the rows were quantized.
            assert not torch.allclose(got, x.double() @ q.dequantized().double().T + bias.double(), rtol=1e-5, atol=0)


@needs_w8a8
@pytest.mark.parametrize("build", W8A8_BUILDS)
def test_a_w8a8_row_is_the_same_bits_alone_and_in_a_batch_and_zero_and_nan_rows_hold(build):
    kernel = w8a8_kernel(build)
    generator = torch.Generator().manual_seed(12)
    q = quantize(torch.randn(72, 600, generator=generator), "int8")
    panels = kernel.pack_quantized(q.values, q.scale)
    rows = torch.randn(11, 600, generator=generator).bfloat16().float()  # 11: blocks of 4, 4 and 3 rows
    together = kernel.product(rows, panels, 72, None)
    assert all(torch.equal(kernel.product(rows[i : i + 1], panels, 72, None)[0], together[i]) for i in range(11))
    assert torch.equal(kernel.product(torch.zeros(1, 600), panels, 72, None), torch.zeros(1, 72))
    for bad in (float("inf"), float("nan")):
        row = torch.ones(1, 600)
        row[0, 7] = bad
        assert kernel.product(row, panels, 72, None).isnan().all()


@pytest.mark.skipif(not SAME_BITS, reason="no AVX512_VNNI or AVX-VNNI CPU: the AVX2 builds have no VPDPBUSD build to agree with here")
@pytest.mark.parametrize("avx2,vnni", SAME_BITS)
def test_the_avx2_and_avx_vnni_builds_give_the_vnni_builds_bits_from_the_same_panels(avx2, vnni):
    """w8a8-avx2 computes each chunk's exact integer sums with VPSIGNB / VPMADDUBSW / VPMADDWD, w8a8-avxvnni with
    VPSIGNB and a 256-bit VPDPBUSD, where w8a8-vnni uses a 512-bit VPDPBUSD, then the same float epilogue: the same
    bits, for any rows (weights of -127 and 127 included, and a row whose largest value is the one quantized to -127:
    the 16-bit pairs' extremes)."""
    a, v = w8a8_kernel(avx2), w8a8_kernel(vnni)
    assert a.layout == v.layout and a.weight_dtype == v.weight_dtype
    generator = torch.Generator().manual_seed(14)
    for out_features, in_features in ((50, 300), (24, 8), (97, 576), (30, 1000), (200, 1536)):
        weight = torch.randn(out_features, in_features, generator=generator)
        edge = min(16, in_features)
        signs = torch.tensor([1.0, -1.0]).repeat(8)[:edge]
        weight[:, :edge] = weight[:, :1].abs() * 50 * signs  # each output's largest: q = 127 and -127
        q = quantize(weight, "int8")
        assert q.values.min() == -127 and q.values.max() == 127
        panels = a.pack_quantized(q.values, q.scale)
        assert torch.equal(panels.view(torch.uint8), v.pack_quantized(q.values, q.scale).view(torch.uint8))
        bias = torch.randn(out_features, generator=generator)
        for rows in (1, 2, 3, 5, 64):
            x = torch.randn(rows, in_features, generator=generator) * 10
            x[:, :edge] = x[:, :1].abs() * 100 * -signs  # digits of -127 and 127 against them
            assert torch.equal(a.product(x, panels, out_features, bias), v.product(x, panels, out_features, bias)), (avx2, out_features, in_features, rows)


@needs_w8a8
def test_a_host_runs_one_w8a8_build_for_both_its_panels_dtypes(monkeypatch):
    """The two builds read the same panels (one dtype each for float32 and bf16 rows), so the product a panel's
    dtype finds is the host's chosen build, or the one DISAGG_W8A8_KERNEL names."""
    try:
        for named in ("avx2", "avxvnni", "vnni"):
            monkeypatch.setenv("DISAGG_W8A8_KERNEL", named)
            small_gemm._w8a8_kernel.cache_clear(), small_gemm._kernel.cache_clear()
            for rows_dtype in (torch.float32, torch.bfloat16):
                chosen = small_gemm.quantized_kernel(torch.int8, rows_dtype, "int8")
                if chosen is None:
                    assert {"vnni": "avx512_vnni", "avxvnni": "avx_vnni"}[named] not in small_gemm.cpu_flags()
                    continue
                assert chosen.name.startswith(f"w8a8-{named}") and chosen.bf16_rows == (rows_dtype == torch.bfloat16)
                assert small_gemm.kernel(chosen.weight_dtype) is chosen
    finally:
        monkeypatch.delenv("DISAGG_W8A8_KERNEL")
        small_gemm._w8a8_kernel.cache_clear(), small_gemm._kernel.cache_clear()


@needs_w8a8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_w8a8_linear_quantizes_the_rows_of_a_decode_step_a_prefill_and_a_long_prefill(dtype):
    """The kernel's rows (a decode step's), a prefill's in blocks of 64, and a long one's (the product in torch over
    the unpacked weight) all multiply the quantized rows by the dequantized weight."""
    from disagg.engine.cpu_kernels.packed_linear import DERIVED_MIN_ROWS

    generator = torch.Generator().manual_seed(13)
    linear = torch.nn.Linear(96, 72, bias=True).to(dtype)
    q = quantize(linear.weight, "int8")
    packed = PackedLinear(linear, quantized=type(q)(q.values, q.scale, activations="int8"))
    assert packed.panels.dtype in small_gemm.W8A8_DTYPES
    for rows in (1, 7, 65, DERIVED_MIN_ROWS):
        x = torch.randn(rows, 96, generator=generator).to(dtype)
        expected = torch.nn.functional.linear(rows_int8(x), q.dequantized(), linear.bias.float())
        got = packed(x).float()
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the output
        assert (got - expected).abs().max() <= tolerance * expected.abs().max(), (rows, dtype)


def test_w8a8_is_refused_at_start_up_where_its_kernel_does_not_run(monkeypatch):
    """A CPU where no W8A8 build runs (no AVX2, or no C compiler) gets one clear line, not full precision's products."""
    from disagg.engine.backends.torch_backend import TorchBackend, TorchBackendConfig

    monkeypatch.setattr(small_gemm, "quantized_kernel", lambda *args, **kwargs: None)
    with pytest.raises(ValueError, match="--quantization w8a8_int8: its kernel needs a CPU with AVX2"):
        TorchBackend(TorchBackendConfig(model=tiny_model("llama"), dtype="float32", quantization="w8a8_int8"))


def test_w8a8_is_refused_on_neuron():
    from disagg.engine.backends.neuron.config import NeuronOptions

    with pytest.raises(ValueError, match="quantization w8a8_int8 .* on Neuron use int8 or fp8"):
        NeuronOptions(model=tiny_model("llama"), quantization="w8a8_int8")


# -- quality ---------------------------------------------------------------------------------------------


def with_int8_rows(model: torch.nn.Module) -> torch.nn.Module:
    """The reference's W8A8: the linears quantize_model made 8-bit (all but the LM head) quantize their input rows."""
    for name, module in model.named_modules():
        if type(module) is torch.nn.Linear and "lm_head" not in name:
            module.register_forward_pre_hook(lambda m, args: (rows_int8(args[0]).to(args[0].dtype),))
    return model


def test_held_out_nll_of_w8a8_within_2_percent():
    """Measured (tiny Llama trained on the local text, its held-out paragraphs): W8A8 over int8 weight-only."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model("llama-held-out")
    tokenizer = AutoTokenizer.from_pretrained(path)
    held_out = paragraphs()[:: TEST_MODELS["llama-held-out"].held_out_every]
    plain = mean_nll(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), held_out, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert quantize_model(model, QuantizationSettings("int8"))
    weight_only = mean_nll(model, held_out, tokenizer)
    w8a8 = mean_nll(with_int8_rows(model), held_out, tokenizer)
    assert w8a8 != weight_only  # the rows were quantized
    assert w8a8 <= plain * 1.02, f"w8a8: {w8a8:.4f} against {plain:.4f} unquantized (int8 weight-only {weight_only:.4f})"


def test_the_engines_w8a8_model_is_the_reference():
    """quantize_model with w8a8_int8 leaves a model whose logits are the independent reference's (the hooks the
    start-up checks and devices without the kernel serve)."""
    from transformers import AutoModelForCausalLM

    path = tiny_model("llama")
    ours = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    weights = quantize_model(ours, QuantizationSettings("w8a8_int8"))
    assert weights and all(w.activations == "int8" and w.values.dtype == torch.int8 for w in weights.values())
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert quantize_model(reference, QuantizationSettings("int8"))
    ids = torch.tensor([list(range(5, 40))])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, with_int8_rows(reference)(ids).logits)


# -- the whole service -----------------------------------------------------------------------------------


@functools.cache
def w8a8_reference(architecture: str) -> Reference:
    ref = Reference(tiny_model(architecture))
    assert quantize_model(ref.model, QuantizationSettings("int8"))
    with_int8_rows(ref.model)
    return ref


@pytest.fixture(scope="module")
def w8a8_cluster(cluster_logs):
    if not W8A8_BUILDS:
        pytest.skip("no AVX2 CPU (or no C compiler): the W8A8 kernel does not run here")
    cluster = start_cluster(cluster_logs / "quantized-w8a8", "llama", batch_size=8, worker_args=["--quantization", "w8a8_int8", "--block-size", str(BLOCK)])
    yield cluster
    cluster.stop()


def test_w8a8_greedy_tokens_equal_generate_with_int8_rows(w8a8_cluster):
    """A mixed batch of different lengths, and prompts that share whole blocks (prefix hits), served side by side."""
    ref = w8a8_reference("llama")
    texts = paragraphs()
    cases = [(" ".join(texts[i].split()[: 3 + (i * 7) % 30]), 6 + (i * 5) % 20) for i in range(8)]
    with Client(w8a8_cluster.router_address, timeout=60) as client:
        assert client.complete(CONTEXT + QUESTIONS[0], max_new_tokens=12).token_ids == ref.greedy(CONTEXT + QUESTIONS[0], 12)
    cases += [(CONTEXT + question, 12) for question in QUESTIONS[1:]]

    async def run():
        async with AsyncClient(w8a8_cluster.router_address, timeout=120) as client:
            return await asyncio.gather(*(client.complete(prompt, max_new_tokens=n) for prompt, n in cases))

    results = asyncio.run(run())
    for (prompt, n), result in zip(cases, results):
        assert result.token_ids == ref.greedy(prompt, n), prompt
    # The rows were quantized: the service's log-probabilities are the W8A8 reference's, not the weight-only model's.
    prompt = CONTEXT + QUESTIONS[1]
    with Client(w8a8_cluster.router_address, timeout=60) as client:
        served = client.complete(prompt, max_new_tokens=8, logprobs=True)
    w8a8_logprobs, weight_only_logprobs = (chosen_logprobs(model, ref.ids(prompt), served.token_ids) for model in (ref.model, weight_only("llama")))
    got = torch.tensor([entry.logprob for entry in served.logprobs])
    # Near the reference's, and nearer it than the weight-only model's by twice over. Not a bound of 1e-3: the float32
    # activations differ between the service and transformers in the last bits as sum orders differ by CPU, so a value
    # at a rounding midpoint of its row's int8 grid can take the other digit. On an Ice Lake Xeon that moved these
    # log-probabilities by up to 4.4e-3 from the reference (1.0e-3 on average; the weight-only model's were 1.8e-2, 3.5e-3).
    to_w8a8, to_weight_only = (got - w8a8_logprobs).abs(), (got - weight_only_logprobs).abs()
    assert to_w8a8.max() < 1e-2 and 2 * to_w8a8.sum() < to_weight_only.sum(), (to_w8a8, to_weight_only)
    assert_nothing_held(w8a8_cluster)


def test_w8a8_through_the_avx2_build_serves_the_same_tokens(cluster_logs):
    """The service with every worker's W8A8 products through AVX2 alone (DISAGG_W8A8_KERNEL=avx2, what a CPU
    without AVX512_VNNI chooses): the reference's greedy tokens, prompts sharing whole blocks included."""
    if small_gemm.build_kernel("w8a8-avx2") is None:
        pytest.skip("no AVX2 CPU (or no C compiler): the AVX2 W8A8 build does not run here")
    import os
    import pathlib

    saved = os.environ.get("DISAGG_W8A8_KERNEL")
    os.environ["DISAGG_W8A8_KERNEL"] = "avx2"  # each worker's own environment: the parts are given the launcher's
    try:
        cluster = start_cluster(cluster_logs / "quantized-w8a8-avx2", "llama", worker_args=["--quantization", "w8a8_int8", "--block-size", str(BLOCK)])
    finally:
        os.environ.pop("DISAGG_W8A8_KERNEL") if saved is None else os.environ.__setitem__("DISAGG_W8A8_KERNEL", saved)
    try:
        for part in ("decode-0", "prefill-0"):
            assert "products: the w8a8-avx2 kernel (DISAGG_W8A8_KERNEL)" in pathlib.Path(cluster.log_path(part)).read_text(), part
        ref = w8a8_reference("llama")
        cases = [(CONTEXT + question, 10) for question in QUESTIONS] + [(" ".join(paragraphs()[3].split()[:20]), 14)]

        async def run():
            async with AsyncClient(cluster.router_address, timeout=120) as client:
                return await asyncio.gather(*(client.complete(prompt, max_new_tokens=n) for prompt, n in cases))

        for (prompt, n), result in zip(cases, asyncio.run(run())):
            assert result.token_ids == ref.greedy(prompt, n), prompt
        assert_nothing_held(cluster)
    finally:
        cluster.stop()


def weight_only(architecture: str) -> torch.nn.Module:
    model = Reference(tiny_model(architecture)).model
    assert quantize_model(model, QuantizationSettings("int8"))
    return model


def chosen_logprobs(model: torch.nn.Module, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    """log p(token) of each generated token, by the model over the prompt and the tokens before it."""
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(token_ids)[:, None])[:, 0]


def test_a_compressed_tensors_w8a8_checkpoint_is_served_w8a8_when_asked(tmp_path):
    """llm-compressor's W8A8 (dynamic per-token int8 activations) checkpoint: weight-only by default, and with
    --quantization w8a8_int8 its stored int8 weights with the rows quantized, as vLLM and SGLang serve it."""
    pytest.importorskip("compressed_tensors")
    from test_quantized_checkpoints import IDS, compressed_checkpoint, reference_logits

    from disagg.engine.quantization.loading import load_weights

    directory = compressed_checkpoint(tmp_path / "w8a8", "int8-channel-w8a8")
    loaded = load_weights(directory, torch.float32, torch.device("cpu"), QuantizationSettings("w8a8_int8"), load_full=None)
    assert loaded.quantized and all(w.activations == "int8" for w in loaded.quantized.values())
    assert "w8a8_int8" in loaded.note and "compressed-tensors" in loaded.note
    weight_only = reference_logits(directory, list(loaded.quantized))  # the file's numbers, rows in full precision
    from transformers import AutoModelForCausalLM

    reference = with_int8_rows(AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32).eval())
    reference.load_state_dict({name: value for name, value in loaded.model.state_dict().items()})
    with torch.no_grad():
        got = loaded.model(IDS).logits
        assert torch.equal(got, reference(IDS).logits) and not torch.equal(got, weight_only)
    with pytest.raises(ValueError, match="already quantized"):
        load_weights(directory, torch.float32, torch.device("cpu"), QuantizationSettings("fp8"), load_full=None)
