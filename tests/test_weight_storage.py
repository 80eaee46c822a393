"""A float32 model of bf16 numbers holds its weights in bf16 (disagg/engine/weight_storage.py): the same bits as
float32 panels, from half the bytes; the service's tokens are transformers' float32 generate() on the checkpoint."""

import asyncio
import pathlib

import pytest
import torch
from conftest import Reference, start_cluster, tiny_model
from test_backend import PROMPTS, run_batch
from test_packed_linear import build_or_skip, needs_kernel

from disagg.clients.grpc_client import AsyncClient
from disagg.engine.backends import load_backend
from disagg.engine.cpu_kernels import small_gemm
from disagg.engine.cpu_kernels.packed_linear import PackedLinear
from disagg.engine.weight_storage import bf16_exact

WIDEN_BUILDS = ["bf16-widen", "bf16-widen-avx512"]


@needs_kernel
@pytest.mark.parametrize("build", WIDEN_BUILDS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features, in_features", [(160, 96), (97, 600), (50, 7), (1, 300), (24, 256)])
def test_each_widen_build_gives_the_float32_builds_bits_over_the_widened_weights(out_features, in_features, bias, build):
    """A bf16 weight widened as it is read is its float32 value exactly, summed in the float32 builds' order: the
    same bits as either float32 build over weight.float(), for 1 to 64 rows (97 outputs: two pairs of panels for
    the AVX-512 blocks of 16 rows or more, then a narrow one alone; K of 600: three chunks)."""
    kernel, float32 = build_or_skip(build), small_gemm.build_kernel("float32")
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features).to(torch.bfloat16)
    bias_values = torch.randn(out_features) if bias else None
    panels, float32_panels = kernel.pack(weight), float32.pack(weight.float())
    assert kernel.layout == "bf16-widen" and panels.dtype == torch.bfloat16
    assert torch.equal(kernel.unpack(panels, out_features, in_features), weight)
    for rows in [1, 2, 3, 5, 8, 9, 16, 17, 31, 32, 33, 64]:
        x = torch.randn(rows, in_features)
        got = kernel.product(x, panels, out_features, bias_values)
        assert torch.equal(got, float32.product(x, float32_panels, out_features, bias_values)), rows
        want = torch.nn.functional.linear(x.double(), weight.double(), None if bias_values is None else bias_values.double())
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), rows


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory) -> str:
    """The tiny llama saved in bf16, as most checkpoints are: every weight a bf16 number."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source, path = tiny_model("llama"), tmp_path_factory.mktemp("bf16-checkpoint")
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(path)
    AutoTokenizer.from_pretrained(source).save_pretrained(path)
    return str(path)


@pytest.fixture
def widen_kernel(monkeypatch):
    """bf16 products through a widen build (float32 rows kept), whatever the host's measured choice would be."""
    build = "bf16-widen-avx512" if small_gemm.build_kernel("bf16-widen-avx512") is not None else "bf16-widen"
    build_or_skip(build)
    monkeypatch.setenv("DISAGG_BF16_KERNEL", build.removeprefix("bf16-"))
    monkeypatch.delenv("DISAGG_F32_WEIGHTS", raising=False)
    small_gemm._kernel.cache_clear()
    yield build
    small_gemm._kernel.cache_clear()


def panel_dtypes(backend) -> set[torch.dtype]:
    return {module.panels.dtype for module in backend.model.modules() if isinstance(module, PackedLinear)}


@needs_kernel
def test_a_float32_model_of_bf16_numbers_is_served_from_bf16_panels_with_float32_panels_bits(bf16_checkpoint, widen_kernel, monkeypatch, caplog):
    """Prefills (a prompt's rows in blocks of 64 too) and batched decode steps give float32 panels' bits exactly,
    and the greedy tokens are transformers' float32 generate() on the checkpoint."""
    with caplog.at_level("INFO"):
        narrow = load_backend("torch", model=bf16_checkpoint, dtype="float32", share_weights=False)
    assert panel_dtypes(narrow) == {torch.bfloat16} and narrow.weight_storage == torch.bfloat16
    assert f"weights held in bf16 and multiplied in float32 (the {widen_kernel} kernel)" in caplog.text
    monkeypatch.setenv("DISAGG_F32_WEIGHTS", "float32")
    wide = load_backend("torch", model=bf16_checkpoint, dtype="float32", share_weights=False)
    assert panel_dtypes(wide) == {torch.float32} and wide.weight_storage is None
    for prompt in ([5], list(range(3, 40)), [(7 * i) % 500 + 3 for i in range(150)]):  # 150 rows: the kernel's blocks of 64
        assert torch.equal(narrow.prefill_logits(prompt, lambda *kv: None), wide.prefill_logits(prompt, lambda *kv: None)), len(prompt)
    ref = Reference(bf16_checkpoint)
    max_new = [12, 7, 16, 9]
    outputs = []
    for backend in (narrow, wide):
        backend.allocate_slots(8)
        assert backend.native is not None  # the native step reads the bf16 panels through the widen build's functions
        outputs.append(run_batch(backend, ref, PROMPTS, max_new, async_mode=True)[0])
    assert outputs[0] == outputs[1]
    for i, prompt in enumerate(PROMPTS):
        assert outputs[0][str(i)] == ref.greedy(prompt, max_new[i]), prompt


@needs_kernel
def test_a_float32_checkpoint_of_other_numbers_keeps_float32_panels(widen_kernel, caplog):
    """The trained tiny llama's float32 weights are not bf16 numbers: held as they are, the log naming a linear whose are not."""
    with caplog.at_level("INFO"):
        backend = load_backend("torch", model=tiny_model("llama"), dtype="float32", share_weights=False)
    assert panel_dtypes(backend) == {torch.float32} and backend.weight_storage is None
    assert "weights held in float32: " in caplog.text and "are not all bf16 numbers" in caplog.text
    assert not bf16_exact(torch.tensor([1.0, 1.0 + 2**-10])) and bf16_exact(torch.tensor([1.0, 1.0 + 2**-7, -1.5 * 2.0**127, 2.0**-133]))


@needs_kernel
def test_a_bf16_build_that_rounds_its_rows_is_not_given_a_float32_models_weights(bf16_checkpoint, monkeypatch):
    """bf16-dot (AVX512_BF16) rounds each row to bf16: a float32 model's rows would lose bits, so its weights stay float32."""
    build_or_skip("bf16-dot")
    monkeypatch.setenv("DISAGG_BF16_KERNEL", "dot")
    small_gemm._kernel.cache_clear()
    try:
        backend = load_backend("torch", model=bf16_checkpoint, dtype="float32", share_weights=False)
        assert panel_dtypes(backend) == {torch.float32}
    finally:
        small_gemm._kernel.cache_clear()


def test_the_variable_is_checked(bf16_checkpoint, monkeypatch):
    monkeypatch.setenv("DISAGG_F32_WEIGHTS", "half")
    with pytest.raises(ValueError, match="DISAGG_F32_WEIGHTS must be bf16 or float32, not 'half'"):
        load_backend("torch", model=bf16_checkpoint, dtype="float32", share_weights=False)


@needs_kernel
def test_the_service_serves_a_bf16_checkpoint_in_float32_from_bf16_panels(bf16_checkpoint, cluster_logs, monkeypatch):
    """Both workers pack (or map the box's file of) bf16 panels; prompts side by side, some sharing a prefix,
    get transformers' float32 greedy tokens."""
    build = "widen-avx512" if small_gemm.build_kernel("bf16-widen-avx512") is not None else "widen"
    monkeypatch.setenv("DISAGG_BF16_KERNEL", build)  # each worker's own environment: the parts are given the launcher's
    monkeypatch.delenv("DISAGG_F32_WEIGHTS", raising=False)
    cluster = start_cluster(cluster_logs / "bf16-storage", "llama", model=bf16_checkpoint)
    try:
        for part in ("prefill-0", "decode-0"):
            assert "weights held in bf16 and multiplied in float32" in pathlib.Path(cluster.log_path(part)).read_text(), part
        ref = Reference(bf16_checkpoint)
        shared = "The lighthouse keeper climbed the stairs every evening, and the lamp"
        cases = [(PROMPTS[0], 10), (shared + " burned", 12), (shared + " went out", 9), (PROMPTS[3], 14)]

        async def run():
            async with AsyncClient(cluster.router_address, timeout=120) as client:
                return await asyncio.gather(*(client.complete(prompt, max_new_tokens=n) for prompt, n in cases))

        for (prompt, n), result in zip(cases, asyncio.run(run())):
            assert result.token_ids == ref.greedy(prompt, n), prompt
    finally:
        cluster.stop()
