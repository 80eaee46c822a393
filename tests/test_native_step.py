"""The decode step in one C call (native_step), against transformers' own step over the same slot cache."""

import pytest
import torch
from conftest import tiny_model

from disagg.engine.backends import load_backend
from disagg.engine.backends.base import StepInputs
from disagg.engine.cpu_kernels import native_step, packed_linear, small_gemm

pytestmark = pytest.mark.skipif(small_gemm.kernel() is None, reason="the native step needs an AVX2 CPU and a C compiler")
needs_bf16_packing = pytest.mark.skipif(
    not packed_linear.can_prepack(torch.device("cpu"), torch.bfloat16), reason="oneDNN does not pack bf16 on this CPU: bf16 keeps transformers' modules"
)


@pytest.fixture(autouse=True)
def one_thread(one_torch_thread):
    """The kernels serve a backend built on one torch thread (the workers' default here)."""


def step_inputs(slots: list[int], positions: list[int], ids: list[int]) -> StepInputs:
    rows = len(slots)
    return StepInputs(
        slots=torch.tensor(slots), positions=torch.tensor(positions), input_ids=torch.tensor(ids), params=torch.zeros(rows, 7),
        seeds=torch.zeros(rows, dtype=torch.long), steps=torch.zeros(rows, dtype=torch.long),
        kv_len=max(positions) + 1, contiguous_from=None, min_position=min(positions),
    )


def random_cache(backend, seed: int = 2) -> None:
    generator = torch.Generator().manual_seed(seed)
    for cache in (*backend.cache.keys, *backend.cache.values):
        cache.copy_(torch.randn(cache.shape, generator=generator))


def both_steps(backend, inputs: StepInputs):
    """(transformers' logits and the K/V it wrote, the native step's), each from the same cache."""
    saved = [t.clone() for t in (*backend.cache.keys, *backend.cache.values)]
    with torch.inference_mode():
        reference = backend._eager_logits(inputs, read_in_place=False)
        reference_kv = [t.clone() for t in (*backend.cache.keys, *backend.cache.values)]
        for tensor, old in zip((*backend.cache.keys, *backend.cache.values), saved):
            tensor.copy_(old)
        native = backend.native.decode_logits(inputs.slots, inputs.positions, inputs.input_ids, inputs.kv_len)
    return reference, reference_kv, native, [*backend.cache.keys, *backend.cache.values]


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral-sw"])  # qwen2: q, k and v biases; mistral-sw: a 16-token window
def test_native_step_equals_transformers_step_over_scattered_slots(name):
    backend = load_backend("torch", model=tiny_model(name), dtype="float32")
    backend.allocate_slots(6)
    assert backend.native is not None
    random_cache(backend)
    # Rows at different positions, in scattered slots, past the window (30 - 16 > 3) and at position 0.
    inputs = step_inputs([0, 3, 4, 5], [30, 3, 0, 17], [5, 6, 7, 8])
    reference, reference_kv, native, native_kv = both_steps(backend, inputs)
    torch.testing.assert_close(native, reference, rtol=1e-4, atol=1e-4)
    assert torch.equal(native.argmax(-1), reference.argmax(-1))
    for ours, theirs in zip(native_kv, reference_kv):  # the same K/V lines written, nothing else touched
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_more_rows_than_one_kernel_block():
    """70 rows: the products go through the kernel 64 rows at a time."""
    backend = load_backend("torch", model=tiny_model("llama"), dtype="float32", max_seq_len=64)
    backend.allocate_slots(72)
    random_cache(backend)
    slots = list(range(1, 71))
    inputs = step_inputs(slots, [(7 * slot) % 60 for slot in slots], [slot % 50 for slot in slots])
    reference, _, native, _ = both_steps(backend, inputs)
    torch.testing.assert_close(native, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["gptj", "gemma2-sw", "bloom"])
def test_other_architectures_keep_transformers_step(name):
    backend = load_backend("torch", model=tiny_model(name), dtype="float32")
    backend.allocate_slots(4)
    assert backend.native is None
    assert native_step.unserved(backend.model, backend.plans) is not None


def test_no_native_step_keeps_transformers_step():
    backend = load_backend("torch", model=tiny_model("llama"), dtype="float32", torch={"native_step": False})
    backend.allocate_slots(4)
    assert backend.native is None


def test_float16_keeps_transformers_step():
    backend = load_backend("torch", model=tiny_model("llama"), dtype="float16")
    backend.allocate_slots(4)
    assert backend.native is None and backend.native_prefill is None


@needs_bf16_packing
def test_a_bf16_native_step_off_by_more_than_bf16_rounding_is_not_used(monkeypatch):
    """bf16's start-up check is looser than float32's (transformers rounds every intermediate),
    but a step off by 15% of the logits' scale (a wrong position or mask moves them by their
    whole scale) keeps transformers' step."""
    right = native_step.NativeModel.decode_logits
    monkeypatch.setattr(native_step.NativeModel, "decode_logits", lambda self, *args: right(self, *args) * 1.15)
    backend = load_backend("torch", model=tiny_model("llama"), dtype="bfloat16")
    backend.allocate_slots(4)
    assert backend.native is None


def test_a_native_step_that_changes_the_logits_is_not_used(monkeypatch):
    """The start-up check: a native step off by 1e-3 of the logits' scale keeps transformers' step."""
    right = native_step.NativeModel.decode_logits
    monkeypatch.setattr(native_step.NativeModel, "decode_logits", lambda self, *args: right(self, *args) * (1 + 1e-3))
    backend = load_backend("torch", model=tiny_model("llama"), dtype="float32")
    backend.allocate_slots(4)
    assert backend.native is None


@pytest.mark.parametrize("field,value", [("slots", [0, 9]), ("positions", [3, 40]), ("input_ids", [0, 10**6]), ("input_ids", [-1, 0])])
def test_out_of_range_rows_are_refused_before_the_c_side_reads_them(field, value):
    backend = load_backend("torch", model=tiny_model("llama"), dtype="float32")
    backend.allocate_slots(4)
    rows = {"slots": torch.tensor([0, 1]), "positions": torch.tensor([3, 4]), "input_ids": torch.tensor([1, 2])}
    rows[field] = torch.tensor(value)
    with pytest.raises(ValueError, match="native step"):
        backend.native.decode_logits(rows["slots"], rows["positions"], rows["input_ids"], 8)


def both_prefills(backend, prompt: list[int]):
    """(transformers' logits and per-layer K/V, the native prefill's) for one prompt."""
    reference_kv, native_kv = {}, {}
    with torch.inference_mode():
        native = backend.native_prefill.prefill_logits(prompt, lambda layer, k, v: native_kv.setdefault(layer, (k, v)))
        saved, backend.native_prefill = backend.native_prefill, None
        try:
            reference = backend.prefill_logits(prompt, lambda layer, k, v: reference_kv.setdefault(layer, (k.clone(), v.clone())))
        finally:
            backend.native_prefill = saved
    return reference, reference_kv, native, native_kv


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral-sw"])
def test_native_prefill_equals_transformers_prefill(name):
    backend = load_backend("torch", model=tiny_model(name), dtype="float32")
    assert backend.native_prefill is not None
    prompt = [(13 * i + 5) % backend.info.vocab_size for i in range(70)]  # past the 16-token window, over one 64-row block
    reference, reference_kv, native, native_kv = both_prefills(backend, prompt)
    torch.testing.assert_close(native, reference, rtol=1e-4, atol=1e-4)
    assert sorted(native_kv) == list(range(backend.info.num_layers))
    for layer, (keys, values) in reference_kv.items():
        assert native_kv[layer][0].shape == keys.shape  # [kv_heads, tokens, head_dim]
        torch.testing.assert_close(native_kv[layer][0], keys, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(native_kv[layer][1], values, rtol=1e-5, atol=1e-5)


def test_long_prefills_go_through_transformers_modules_counting_only_the_rows_past_the_cached_prefix(monkeypatch):
    backend = load_backend("torch", model=tiny_model("llama"), dtype="float32")
    monkeypatch.setattr(native_step, "PREFILL_MAX_ROWS", 8)
    called = []
    monkeypatch.setattr(backend.native_prefill, "prefill_logits", lambda *args: called.append(args) or torch.zeros(1, 1))
    backend.prefill_logits(list(range(9)), lambda *kv: None)
    assert not called
    backend.prefill_logits(list(range(8)), lambda *kv: None)
    assert len(called) == 1
    info = backend.info
    prefix = [(torch.zeros(info.kv_heads, 6, info.head_dim), torch.zeros(info.kv_heads, 6, info.head_dim)) for _ in range(info.num_layers)]
    backend.prefill_logits(list(range(14)), lambda *kv: None, prefix)  # 8 rows past a 6-token prefix
    assert len(called) == 2


def test_bf16_prefills_past_64_rows_take_onednn_when_torch_has_more_than_one_thread():
    assert native_step.prefill_max_rows(torch.bfloat16, 1) == native_step.prefill_max_rows(torch.float32, 2) == native_step.PREFILL_MAX_ROWS
    assert native_step.prefill_max_rows(torch.bfloat16, 2) == native_step.PREFILL_MAX_ROWS_BF16_THREADED == 64


def test_an_exception_in_the_layer_callback_stops_the_native_prefill_and_is_raised():
    backend = load_backend("torch", model=tiny_model("llama"), dtype="float32")
    seen = []

    def on_layer(layer, keys, values):
        seen.append(layer)
        if layer == 1:
            raise ConnectionError("the decode worker went away")

    with pytest.raises(ConnectionError, match="went away"):
        backend.prefill_logits([1, 2, 3], on_layer)
    assert seen == [0, 1]  # stopped at the layer that failed
    backend.prefill_logits([1, 2, 3], lambda *kv: None)  # and the next prompt runs


def test_a_native_prefill_that_changes_the_kv_is_not_used(monkeypatch):
    right = native_step.NativeModel.prefill_logits

    def wrong_values(self, prompt, on_layer):
        return right(self, prompt, lambda layer, k, v: on_layer(layer, k, v * (1 + 1e-3)))

    monkeypatch.setattr(native_step.NativeModel, "prefill_logits", wrong_values)
    backend = load_backend("torch", model=tiny_model("llama"), dtype="float32")
    assert backend.native_prefill is None


def test_rotary_angles_narrower_than_a_head_are_refused():
    """A partial rotation (angles for part of each head): the C side would read past them, so the model is not served."""
    backend = load_backend("torch", model=tiny_model("llama"), dtype="float32")
    rotary = backend.model.model.rotary_emb
    full = rotary.forward
    rotary.forward = lambda x, position_ids: tuple(t[..., : t.shape[-1] // 2] for t in full(x, position_ids))
    with pytest.raises(ValueError, match="rotary angles cover"):
        native_step.NativeModel(backend.model, backend.plans)


def float32_over_bf16_weights(name: str):
    """A float32 backend (transformers' modules) over the checkpoint's weights rounded to
    bf16: the arithmetic a bf16 native step does, in float32 throughout."""
    from transformers import AutoModelForCausalLM

    from disagg.engine.backends.torch_backend import TorchBackend, TorchBackendConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_model(name), dtype=torch.bfloat16).float().eval()
    return TorchBackend(TorchBackendConfig(model=tiny_model(name), dtype="float32", native_step=False), model=model)



@pytest.fixture(params=["widen", "dot"])
def bf16_kernel(request, monkeypatch):
    """Each bf16 product kernel this CPU runs, named as DISAGG_BF16_KERNEL names it."""
    if small_gemm.build_kernel(f"bf16-{request.param}") is None:
        pytest.skip(f"the bf16-{request.param} kernel does not run on this CPU")
    monkeypatch.setenv("DISAGG_BF16_KERNEL", request.param)
    small_gemm._kernel.cache_clear()
    yield request.param
    small_gemm._kernel.cache_clear()


# How far a bf16 native step's logits may be from float32 arithmetic over the same bf16
# weights and cache, in the logits' scale. widen: only the row's own K/V line is rounded (to
# bf16, as it is written); dot: each product's input row is rounded too, as a bf16 model's
# products take them. transformers' bf16 modules, which round every intermediate, are 5e-3 to
# 9e-3 off on these models.
BF16_STEP_TOLERANCE = {"widen": 4e-3, "dot": 8e-3}


@needs_bf16_packing
@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral-sw"])
def test_a_bf16_native_step_is_the_float32_step_over_bf16_weights(name, bf16_kernel):
    """bf16 weights, embedding and cache, float32 arithmetic: against a float32 step over the
    same (widened) weights and cache, within BF16_STEP_TOLERANCE."""
    backend = load_backend("torch", model=tiny_model(name), dtype="bfloat16")
    backend.allocate_slots(6)
    assert backend.native is not None and backend.cache.keys[0].dtype == torch.bfloat16
    reference = float32_over_bf16_weights(name)
    reference.allocate_slots(6)
    random_cache(backend)
    for ours, theirs in zip((*backend.cache.keys, *backend.cache.values), (*reference.cache.keys, *reference.cache.values)):
        theirs.copy_(ours)
    inputs = step_inputs([0, 3, 4, 5], [30, 3, 0, 17], [5, 6, 7, 8])
    with torch.inference_mode():
        want = reference._eager_logits(inputs, read_in_place=False)
        got = backend.native.decode_logits(inputs.slots, inputs.positions, inputs.input_ids, inputs.kv_len)
    assert (got - want).abs().max() <= BF16_STEP_TOLERANCE[bf16_kernel] * want.abs().max()
    for layer, (ours, theirs) in enumerate(zip((*backend.cache.keys, *backend.cache.values), (*reference.cache.keys, *reference.cache.values))):
        # The lines the step wrote: the first layer's rounded once to bf16; later layers' also read the rounded lines before them.
        assert (ours.float() - theirs).abs().max() <= (2**-8 if layer in (0, len(backend.cache.keys)) else 1e-2) * theirs.abs().max()


@needs_bf16_packing
def test_a_bf16_native_prefill_is_the_float32_prefill_over_bf16_weights(bf16_kernel):
    backend = load_backend("torch", model=tiny_model("mistral-sw"), dtype="bfloat16")  # past its 16-token window
    assert backend.native_prefill is not None
    reference = float32_over_bf16_weights("mistral-sw")
    prompt = [(11 * i + 3) % backend.info.vocab_size for i in range(40)]
    ours, theirs = [], []
    with torch.inference_mode():
        got = backend.native_prefill.prefill_logits(prompt, lambda layer, k, v: ours.append((k.clone(), v.clone())))
        want = reference.prefill_logits(prompt, lambda layer, k, v: theirs.append((k.clone(), v.clone())))
    # Later rows attend over bf16-rounded lines where the reference keeps float32 ones.
    assert (got - want).abs().max() <= 5e-3 * want.abs().max()
    for (our_k, our_v), (their_k, their_v) in zip(ours, theirs):
        assert our_k.dtype == torch.bfloat16
        for a, b in ((our_k, their_k), (our_v, their_v)):
            assert (a.float() - b).abs().max() <= 1e-2 * b.abs().max()


def greedy_equals_generate(backend, architecture: str = "llama") -> None:
    from conftest import reference
    from test_backend import PROMPTS, run_batch

    ref = reference(architecture)
    backend.allocate_slots(6)
    max_new = [6, 11, 17, 23]
    out, _, _ = run_batch(backend, ref, PROMPTS, max_new, async_mode=True, slots=[1, 4, 2, 5])
    for i, prompt in enumerate(PROMPTS):
        assert out[str(i)] == ref.greedy(prompt, max_new[i]), prompt


def test_two_torch_threads_keep_the_kernels_and_the_native_step():
    """Whatever the torch thread count: a worker on two threads still packs for the kernel and
    steps natively (its split products go to one helper per extra thread), with generate()'s tokens."""
    torch.set_num_threads(2)  # the autouse fixture puts the count back
    backend = load_backend("torch", model=tiny_model("llama"), dtype="float32")
    assert backend.native_prefill is not None
    greedy_equals_generate(backend)
    assert backend.native is not None


@pytest.fixture
def no_kernels(monkeypatch):
    """A CPU the kernels do not serve (an ARM Graviton, an x86 without AVX2), as PyTorch reports it."""
    from disagg.engine.cpu_kernels import slot_attention

    caches = (small_gemm._kernel, small_gemm.build_kernel, slot_attention._kernel, native_step._library)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_a_cpu_without_a_usable_kernel_keeps_transformers_modules(no_kernels, architecture):
    backend = load_backend("torch", model=tiny_model(architecture), dtype="float32")
    assert small_gemm.kernel() is None and backend.native_prefill is None
    greedy_equals_generate(backend, architecture)
    assert backend.native is None and not backend.reads_in_place
