"""Prepacked linear weights (the CPU default): the same products as nn.Linear, in and out of a graph."""

import pytest
import torch

from conftest import reference, tiny_model
from disagg.engine.backends import load_backend
from disagg.engine.backends import packed_linear
from disagg.engine.backends.packed_linear import PackedLinear, can_prepack, prepack_linears
from test_backend import PROMPTS, run_batch

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_nn_linear_for_any_number_of_rows(dtype, tolerance, bias):
    if not can_prepack(CPU, dtype):
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU")
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160, bias=bias).to(dtype)
    packed = PackedLinear(linear)
    assert packed.weight.shape == linear.weight.shape and bool((packed.weight == linear.weight).all())
    for shape in [(1, 96), (1, 1, 96), (2, 96), (3, 1, 96), (5, 7, 96), (64, 96)]:
        x = torch.randn(shape).to(dtype)
        want, got = linear(x), packed(x)
        assert got.shape == want.shape and got.dtype == dtype
        assert (got.float() - want.float()).abs().max() <= tolerance * want.float().abs().max(), shape


def test_packed_linear_in_a_compiled_graph_with_changing_rows():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    packed = PackedLinear(linear)
    graph = torch.compile(lambda x: torch.nn.functional.silu(packed(x)), fullgraph=True, dynamic=True)
    with torch.inference_mode():
        for rows in (1, 2, 5, 8):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(graph(x), torch.nn.functional.silu(linear(x)), rtol=1e-5, atol=1e-5)


def test_prepacking_replaces_every_linear_and_keeps_a_tied_embedding():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model("llama"), dtype=torch.float32).eval()
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    ids = torch.tensor([[5, 9, 14, 3]])
    with torch.inference_mode():
        want = model(ids).logits
        assert prepack_linears(model) == linears > 0
        got = model(ids).logits
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_cpu_backend_prepacks_by_default_and_decodes_as_generate():
    ref = reference("llama")
    backend = load_backend("torch", model=tiny_model("llama"), dtype="float32", max_seq_len=128)
    assert any(isinstance(m, PackedLinear) for m in backend.model.modules())
    backend.allocate_slots(4)
    max_new = [5, 9, 13, 21]  # one row, then several: both product paths
    out, _, _ = run_batch(backend, ref, PROMPTS, max_new, async_mode=True)
    for i, prompt in enumerate(PROMPTS):
        assert out[str(i)] == ref.greedy(prompt, max_new[i]), prompt
    plain = load_backend("torch", model=tiny_model("llama"), dtype="float32", max_seq_len=128, prepack=False)
    assert not any(isinstance(m, PackedLinear) for m in plain.model.modules())


def test_a_dtype_onednn_cannot_pack_here_keeps_the_plain_linears():
    assert can_prepack(CPU, torch.float32) and not can_prepack(CPU, torch.float16)
    backend = load_backend("torch", model=tiny_model("llama"), dtype="bfloat16", max_seq_len=128)
    assert any(isinstance(m, PackedLinear) for m in backend.model.modules()) == can_prepack(CPU, torch.bfloat16)


@pytest.mark.parametrize("wrong_rows", [1, 4])
def test_prepacked_linears_that_change_the_logits_are_refused_at_start_up(monkeypatch, wrong_rows):
    from disagg.engine.backends.architectures import UnsupportedModel

    right = packed_linear.packed_product
    # A product that is wrong for one row count only: the start-up check tries both paths.
    monkeypatch.setattr(packed_linear, "packed_product", lambda rows, *weights: right(rows, *weights) * (1.5 if rows.shape[0] == wrong_rows else 1.0))
    with pytest.raises(UnsupportedModel, match="logits change with prepacked linear layers"):
        load_backend("torch", model=tiny_model("llama"), dtype="float32", max_seq_len=128)
