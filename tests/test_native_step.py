"""The decode step in one C call (native_step), against transformers' own step over the same slot cache."""

import pytest
import torch
from conftest import tiny_model

from disagg.engine.backends import load_backend
from disagg.engine.backends.base import StepInputs
from disagg.engine.cpu_kernels import native_step, packed_linear, prefill_attention, small_gemm

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


def native_and_reference_logits(backend, reference) -> tuple[torch.Tensor, torch.Tensor]:
    """(the native step's logits, the reference backend's transformers step's) over the same random cache
    (copied into the reference's, both with their slots allocated), four rows at scattered positions; each
    cache then holds the lines its own step wrote."""
    random_cache(backend)
    for ours, theirs in zip((*backend.cache.keys, *backend.cache.values), (*reference.cache.keys, *reference.cache.values)):
        theirs.copy_(ours)
    inputs = step_inputs([0, 3, 4, 5], [30, 3, 0, 17], [5, 6, 7, 8])
    with torch.inference_mode():
        want = reference._eager_logits(inputs, read_in_place=False)
        got = backend.native.decode_logits(inputs.slots, inputs.positions, inputs.input_ids, inputs.kv_len)
    return got, want


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


@pytest.mark.parametrize("field,value", [
    ("slots", [0, 9]), ("slots", [[0, 1], [2, 9]]), ("slots", [-1, 0]), ("positions", [3, 40]), ("positions", [-1, 3]), ("positions", [3]),
    ("input_ids", [0, 10**6]), ("input_ids", [-1, 0]), ("input_ids", [1, 2, 3]),
])
def test_out_of_range_rows_are_refused_before_the_c_side_reads_them(field, value):
    backend = load_backend("torch", model=tiny_model("llama"), dtype="float32")
    backend.allocate_slots(4)
    rows = {"slots": torch.tensor([0, 1]), "positions": torch.tensor([3, 4]), "input_ids": torch.tensor([1, 2])}
    rows[field] = torch.tensor(value)
    with pytest.raises(ValueError, match="native step"):
        backend.native.decode_logits(rows["slots"], rows["positions"], rows["input_ids"], 8)


def test_the_rotary_angles_read_from_the_table_of_every_position_give_the_bits_of_the_module_s_own_call():
    """A step reads its rows' rotary angles by position from a table the model's rotary module computed for
    every position up to the largest seen (grown as positions pass its end), not from a call of the module
    for the step's positions: the logits and the lines written are the same bits either way."""
    backend = load_backend("torch", model=tiny_model("llama"), dtype="float32")
    backend.allocate_slots(6)
    native = backend.native
    assert native.angles is not None
    for inputs in (step_inputs([0, 3, 5], [300, 3, 17], [5, 6, 7]), step_inputs([1, 4], [450, 12], [8, 9])):  # 301 positions, then 451
        random_cache(backend)
        saved = [t.clone() for t in (*backend.cache.keys, *backend.cache.values)]
        with torch.inference_mode():
            by_table = native.decode_logits(inputs.slots, inputs.positions, inputs.input_ids, inputs.kv_len)
            table_cache = [t.clone() for t in (*backend.cache.keys, *backend.cache.values)]
            assert inputs.kv_len <= native.angles.cos.shape[0] <= backend.model.config.max_position_embeddings  # grown, not past the model's
            for tensor, old in zip((*backend.cache.keys, *backend.cache.values), saved):
                tensor.copy_(old)
            angles, native.angles = native.angles, None  # the module called for the step's positions
            try:
                by_call = native.decode_logits(inputs.slots, inputs.positions, inputs.input_ids, inputs.kv_len)
            finally:
                native.angles = angles
        assert torch.equal(by_table, by_call)
        assert all(torch.equal(a, b) for a, b in zip(table_cache, (*backend.cache.keys, *backend.cache.values)))


def test_rotary_angles_that_depend_on_the_sequence_s_length_are_computed_for_each_step():
    """transformers' dynamic and longrope rotary types rescale their frequencies as a sequence grows: no table."""
    backend = load_backend("torch", model=tiny_model("llama"), dtype="float32")
    rotary = backend.model.model.rotary_emb
    for rope_type, tabled in (("default", True), ("dynamic", False), ("longrope", False)):
        rotary.rope_type = rope_type
        assert (native_step.angles_table(rotary, backend.model.model.embed_tokens.weight, 512) is not None) is tabled


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


def test_bf16_prefills_past_256_rows_take_onednn_when_torch_has_more_than_one_thread():
    assert native_step.prefill_max_rows(torch.bfloat16, 1) == native_step.prefill_max_rows(torch.float32, 2) == native_step.PREFILL_MAX_ROWS
    assert native_step.prefill_max_rows(torch.bfloat16, 2) == native_step.PREFILL_MAX_ROWS_BF16_THREADED == 256
    # On one thread, a prompt whose attention is prefill_attention.c's blocked one runs natively to 1,024 rows.
    assert native_step.prefill_max_rows(torch.bfloat16, 1, blocked=True) == native_step.PREFILL_MAX_ROWS_BLOCKED == 1024
    assert native_step.prefill_max_rows(torch.bfloat16, 2, blocked=True) == 256


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



@needs_bf16_packing
@pytest.mark.skipif(prefill_attention.kernel() is None, reason="prefill_attention.c needs AVX512_BF16")
@pytest.mark.parametrize("cached, rows", [(0, 100), (60, 40)], ids=["whole-prompt", "past-a-cached-prefix"])
def test_a_bf16_prompt_of_16_rows_or_more_attends_blocked_and_gives_the_float32_prefill(cached, rows):
    """Its attention through prefill_attention.c (bf16 inputs, float32 sums, as transformers' bf16 attention),
    called from native_step.c: logits and K/V within bf16's distance of float32 arithmetic over the bf16 weights;
    prompts of fewer rows attend row by row."""
    backend = load_backend("torch", model=tiny_model("llama-head64"), dtype="bfloat16")
    native = backend.native_prefill
    assert native is not None and native.blocks_prompts
    assert backend._native_prefill_rows() == native_step.PREFILL_MAX_ROWS_BLOCKED  # one torch thread here
    reference = float32_over_bf16_weights("llama-head64")
    prompt = [(13 * i + 5) % backend.info.vocab_size for i in range(cached + rows)]
    prefix, kept = None, []
    if cached:
        with torch.inference_mode():
            reference.prefill_logits(prompt[:cached], lambda layer, k, v: kept.append((k.to(torch.bfloat16), v.to(torch.bfloat16))))
        prefix = kept  # per layer [kv_heads, cached, head_dim], in the model's dtype
    ours, theirs = [], []
    before = native.model.blocked_calls
    with torch.inference_mode():
        got = native.prefill_logits(prompt, lambda layer, k, v: ours.append((k.clone(), v.clone())), prefix)
        want = reference.prefill_logits(prompt, lambda layer, k, v: theirs.append((k.clone(), v.clone())))
        assert native.model.blocked_calls == before + 1
        native.prefill_logits(prompt[:15], lambda *kv: None)  # under MIN_ROWS: row by row
        assert native.model.blocked_calls == before + 1
    assert (got - want).abs().max() <= 5e-3 * want.abs().max()
    for (our_k, our_v), (their_k, their_v) in zip(ours, theirs):  # [kv_heads, rows, head_dim]: the new rows' lines
        for a, b in ((our_k, their_k[:, cached:]), (our_v, their_v[:, cached:])):
            assert a.dtype == torch.bfloat16 and a.shape == b.shape == (1, rows, 64)
            assert (a.float() - b).abs().max() <= 1e-2 * b.abs().max()


@pytest.fixture(params=["widen", "widen-avx512", "dot"])
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
BF16_STEP_TOLERANCE = {"widen": 4e-3, "widen-avx512": 4e-3, "dot": 8e-3}


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
    got, want = native_and_reference_logits(backend, reference)
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

    caches = (small_gemm._kernel, small_gemm._int8_kernel, small_gemm.build_kernel, slot_attention._kernel, native_step._library)
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


# An 8-bit KV cache (--kv-cache-dtype): the native step's builds over codes append each line as
# QuantizedBlocks.append_lines does, and attend through slot_attention's 8-bit build.
KV_CODES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def e4m3_sample() -> torch.Tensor:
    """float32 values for the float32 -> e4m3fn conversion: every e4m3 value, the ties halfway
    between neighbours (and a float32 ulp either side), subnormal ties, values past the clamp,
    zeros of both signs, infinities, and random bit patterns over the exponents around e4m3's."""
    values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = values[~values.isnan()].unique()  # ascending, -448 .. 448 (one zero)
    ties = (finite[1:] + finite[:-1]) / 2  # exact in float32
    near = torch.cat([ties, torch.nextafter(ties, torch.full_like(ties, float("inf"))), torch.nextafter(ties, torch.full_like(ties, -float("inf")))])
    subnormal_ties = (torch.arange(8) + 0.5) * 2.0**-9
    edges = torch.tensor([0.0, -0.0, 448.0, -448.0, 449.0, -464.0, 464.0, 480.0, 1e30, -1e30, float("inf"), -float("inf"), 2.0**-6, 2.0**-10, 2.0**-30])
    generator = torch.Generator().manual_seed(3)
    exponents = torch.randint(100, 140, (200_000,), generator=generator, dtype=torch.int32)  # 2^-27 .. 2^12
    bits = (exponents << 23) | torch.randint(0, 1 << 23, (200_000,), generator=generator, dtype=torch.int32)
    bits |= torch.randint(0, 2, (200_000,), generator=generator, dtype=torch.int32) << 31
    return torch.cat([finite, near, subnormal_ties, -subnormal_ties, edges, bits.view(torch.float32)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_steps_fp8_codes_are_torchs_cast_after_the_clamp(dtype):
    from disagg.engine.quantization.kv_cache import to_codes

    scaled = e4m3_sample()
    ours = native_step.codes(scaled, torch.float8_e4m3fn, dtype)
    theirs = to_codes(scaled, torch.float8_e4m3fn)
    mismatched = (ours.view(torch.uint8) != theirs.view(torch.uint8)).nonzero()[:5, 0]
    assert mismatched.numel() == 0, [(scaled[i].item(), ours.view(torch.uint8)[i].item(), theirs.view(torch.uint8)[i].item()) for i in mismatched]


def test_the_c_steps_int8_codes_round_half_to_even_within_127():
    from disagg.engine.quantization.kv_cache import to_codes

    halves = torch.arange(-140, 140) + 0.5
    generator = torch.Generator().manual_seed(4)
    near = torch.nextafter(halves, torch.zeros_like(halves))
    scaled = torch.cat([halves, near, torch.randn(100_000, generator=generator) * 80, torch.tensor([-0.0, 1e30, -1e30])])
    assert torch.equal(native_step.codes(scaled, torch.int8), to_codes(scaled, torch.int8))


def random_codes(shape, code_dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Codes over the format's whole range."""
    values = torch.randn(shape, generator=generator) * (40 if code_dtype == torch.int8 else 100)
    limit = 127 if code_dtype == torch.int8 else 448
    values = values.clamp(-limit, limit)
    return (values.round() if code_dtype == torch.int8 else values).to(code_dtype)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_append_of_a_line_is_append_lines_byte_for_byte(kv_cache_dtype, dtype):
    """The same lines (the model's dtype) into the same blocks: the same codes and scales, for a
    block's first line, a line within its scale, one that grows it (its codes coded again), and
    one into a block whose scale is still zero."""
    from disagg.engine.quantization.kv_cache import QuantizedBlocks

    code_dtype, generator = KV_CODES[kv_cache_dtype], torch.Generator().manual_seed(5)
    blocks, heads, size, head_dim = 6, 3, 16, 64
    codes = random_codes((blocks, heads, size, head_dim), code_dtype, generator)
    scales = torch.rand(blocks, heads, generator=generator) / 40
    scales[4] = 0.0
    rows = torch.tensor([1, 3, 4, 0]), torch.tensor([0, 9, 5, 15])  # blocks, offsets
    lines = (torch.randn(4, heads, head_dim, generator=generator) * torch.tensor([1.0, 4.0, 2.0, 0.2])[:, None, None]).to(dtype)
    lines[2, 1] = 0.0  # a line of zeros into a block of zero scale
    theirs = QuantizedBlocks(codes.clone(), scales.clone())
    theirs.append_lines(*rows, lines)
    ours = QuantizedBlocks(codes.clone(), scales.clone())
    for row, (block, offset) in enumerate(zip(*rows)):
        for head in range(heads):
            native_step.append_line(ours.codes[block, head], ours.scales[block, head : head + 1], int(offset), lines[row, head].float(), dtype)
    grown = (theirs.scales > scales)[[1, 3, 0]]
    assert bool(grown.any()) and not bool(grown.all())  # some grew (coded again), some did not
    assert torch.equal(ours.scales, theirs.scales)
    assert torch.equal(ours.codes.view(torch.uint8), theirs.codes.view(torch.uint8))


def random_8_bit_cache(backend, seed: int = 6) -> None:
    """Codes over the format's range and scales that bring them near the model's K/V magnitudes."""
    generator = torch.Generator().manual_seed(seed)
    for codes in (*backend.cache.keys, *backend.cache.values):
        codes.copy_(random_codes(codes.shape, codes.dtype, generator))
    for scales in (*backend.cache.key_scales, *backend.cache.value_scales):
        scales.copy_(torch.rand(scales.shape, generator=generator) / 40)


def cache_state(backend) -> list[torch.Tensor]:
    cache = backend.cache
    return [t.clone() for t in (*cache.keys, *cache.values, *cache.key_scales, *cache.value_scales)]


def both_8_bit_steps(backend, inputs: StepInputs, monkeypatch):
    """(transformers' logits, the cache it left and the lines it appended, in order: [n, kv_heads, head_dim]
    per layer's keys, then values; the native step's logits and cache), each from the same cache; the native step's cache stays."""
    from disagg.engine.quantization.kv_cache import QuantizedBlocks

    cache, lines = backend.cache, []
    tensors = (*cache.keys, *cache.values, *cache.key_scales, *cache.value_scales)
    saved = cache_state(backend)
    append = QuantizedBlocks.append_lines
    with torch.inference_mode(), monkeypatch.context() as patch:
        patch.setattr(QuantizedBlocks, "append_lines", lambda blocks, *args: lines.append(args[2].clone()) or append(blocks, *args))
        reference = backend._eager_logits(inputs, read_in_place=False)
    reference_state = cache_state(backend)
    with torch.inference_mode():
        for tensor, old in zip(tensors, saved):
            tensor.copy_(old)
        native = backend.native.decode_logits(backend._tables(inputs), inputs.positions, inputs.input_ids, inputs.kv_len)
    return reference, reference_state, lines, native, cache_state(backend)


def native_first_layer_lines(backend, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The native step's first-layer key and value lines [n, kv_heads, head_dim] (they read no cache):
    from the same step over a cache of the same blocks in the model's dtype, which keeps them as computed."""
    from disagg.engine.backends.slot_kv_cache import PagedKvCache

    cache, info = backend.cache, backend.info
    plain = PagedKvCache.allocate(info.num_layers, cache.keys[0].shape[0], info.kv_heads, cache.block_size, info.head_dim, backend.dtype, "cpu")
    tables = backend._tables(inputs)
    blocks, offsets = tables.gather(1, (inputs.positions // cache.block_size)[:, None])[:, 0], inputs.positions % cache.block_size
    backend.native.attach(plain)
    try:
        with torch.inference_mode():
            backend.native.decode_logits(tables, inputs.positions, inputs.input_ids, inputs.kv_len)
    finally:
        backend.native.attach(cache)
    return plain.keys[0][blocks, :, offsets], plain.values[0][blocks, :, offsets]


def dequantized_blocks(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return codes.float() * scales[..., None, None]


def one_code_apart(ours: tuple[torch.Tensor, torch.Tensor], theirs: tuple[torch.Tensor, torch.Tensor], code_dtype: torch.dtype, apart: float) -> bool:
    """One block and head's (codes, scale) each, from lines `apart` from each other (relative to the block's largest
    magnitude: rounding errors are the sums', not an element's): scales that far apart, values a code step apart
    at most (each rounds within half a step of the value under its own scale) besides."""
    ours_values, theirs_values = dequantized_blocks(*ours), dequantized_blocks(*theirs)
    scale, magnitude = torch.maximum(ours[1], theirs[1]), torch.maximum(ours_values.abs(), theirs_values.abs())
    step = scale if code_dtype == torch.int8 else 0.125 * magnitude + scale * 2.0**-9  # e4m3: 3 mantissa bits
    close_scales = bool((ours[1] - theirs[1]).abs() <= apart * theirs[1])
    return close_scales and bool(((ours_values - theirs_values).abs() <= 1.001 * step + apart * magnitude.max()).all())


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=needs_bf16_packing)])
def test_native_steps_over_an_8_bit_cache_write_the_eager_steps_codes_and_scales(dtype, kv_cache_dtype, monkeypatch):
    """Three steps of three rows in scattered blocks: one in a block whose scales start small (its
    lines grow them and its codes are coded again), one from a fresh block's first position, one
    within a block's scale. float32: where a row's line is the eager step's bit for bit (the first
    layer's mostly: the same products and rotation of the same embedding, but the norm sums in
    another order), the block's codes and scale are the same bytes; elsewhere (later layers read
    the attention's output, summed in another order too) a line differs in its last bits, and a code
    may land one step away. bf16: transformers' modules round every intermediate to bf16 where the
    native step rounds only the line, so no layer's lines are the same bits: the values are close
    (test_the_c_append_of_a_line_is_append_lines_byte_for_byte: the same bf16 lines, the same bytes)."""
    from disagg.engine.backends.torch_backend import agrees

    code_dtype = KV_CODES[kv_cache_dtype]
    backend = load_backend("torch", model=tiny_model("llama"), dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    backend.allocate_slots(4, num_blocks=24, block_size=16)
    assert backend.native is not None and backend.cache.quantized
    tables = {0: [5, 17, 2, 9], 2: [11, 3, 20, 7], 3: [14, 1, 22, 6]}
    for slot, table in tables.items():
        backend.set_block_table(slot, table)
    random_8_bit_cache(backend)
    for scales in (*backend.cache.key_scales, *backend.cache.value_scales):
        scales[2] /= 100  # slot 0's third block: its lines outgrow these
    layers, heads = backend.info.num_layers, backend.info.kv_heads
    written, grown, exact = [2, 7, 1], 0, 0  # the rows' blocks: positions 37.., 48.. (a fresh block's first), 20..
    for step in range(3):
        inputs = step_inputs(list(tables), [37 + step, 48 + step, 20 + step], [5 + step, 9, 300 - step])
        before = cache_state(backend)
        native_lines = native_first_layer_lines(backend, inputs) if dtype == "float32" else None
        reference, theirs, eager_lines, native, ours = both_8_bit_steps(backend, inputs, monkeypatch)
        assert agrees(reference, native, backend.dtype)
        if dtype == "float32":  # (bf16's agreement is looser than a tiny model's near-tied logits)
            assert torch.equal(native.argmax(-1), reference.argmax(-1))
        growing = [2, 7] if step else [2]  # blocks past their first line (7 took its first at step 0)
        grown += sum(int((ours[i][growing] > before[i][growing]).sum()) for i in range(2 * layers, 4 * layers))
        untouched = [b for b in range(24) if b not in written]
        for i in range(2 * layers):  # keys per layer, then values
            # Nothing but the rows' blocks changed.
            assert torch.equal(ours[i][untouched].view(torch.uint8), before[i][untouched].view(torch.uint8))
            assert torch.equal(ours[2 * layers + i][untouched], before[2 * layers + i][untouched])
            lines = eager_lines[2 * (i % layers) + i // layers]  # append_lines is called per layer, keys then values
            same = None if native_lines is None or i % layers else (native_lines[i // layers] == lines).all(-1)  # [n, kv_heads]
            for row, block in enumerate(written):
                for head in range(heads):
                    pair = [(state[i][block, head], state[2 * layers + i][block, head]) for state in (ours, theirs)]
                    if same is not None and bool(same[row, head]):
                        assert torch.equal(pair[0][0].view(torch.uint8), pair[1][0].view(torch.uint8)) and torch.equal(pair[0][1], pair[1][1])
                        exact += 1
                    else:  # float32: lines a few float32 ulps apart; bf16: a few bf16 ulps (2^-8 each)
                        assert one_code_apart(pair[0], pair[1], code_dtype, 1e-4 if dtype == "float32" else 0.03), (step, i, row, head)
    assert grown > 0  # the scales grew, some block's codes coded again
    assert exact >= (3 * 3 * 2 * heads // 2 if dtype == "float32" else 0)  # most first-layer lines are the same bits


ROWS = {4: ([0, 2, 3, 5], [30, 3, 17, 44], [5, 6, 7, 8]), 3: ([0, 3, 5], [30, 17, 44], [5, 7, 8]), 1: ([3], [40], [7])}


# mistral-sw: a 16-token window; 1 and 3 rows: a KV head of a row a unit (the tiny models have 2 KV heads)
@pytest.mark.parametrize("name, kv_cache_dtype, rows", [
    ("llama", None, 4), ("mistral-sw", None, 4), ("llama", "int8", 4), ("llama", None, 1), ("mistral-sw", None, 3), ("llama", "int8", 1),
])
def test_a_step_s_attention_shared_with_the_helper_gives_the_bits_of_one_core(name, kv_cache_dtype, rows):
    """A step of 4 rows or more (reading enough K and V) shares its rows' attention with the products'
    helper (native_step.c, split_attention), each row computed whole by whichever core claims it; a step
    of fewer rows shares it a KV head of a row a unit (attend_heads_job). Either way the logits and the
    cache it leaves are the bits of the same step on the calling core alone. The caller claims one unit
    a job, so the helper computes the others."""
    backend = load_backend("torch", model=tiny_model(name), dtype="float32", kv_cache_dtype=kv_cache_dtype)
    inputs = step_inputs(*ROWS[rows])
    if kv_cache_dtype:
        backend.allocate_slots(6, num_blocks=30, block_size=16)
        for slot in inputs.slots.tolist():
            backend.set_block_table(slot, [1 + slot + 6 * i for i in range(4)])
        random_8_bit_cache(backend)
        tables, model = backend._tables(inputs), backend.native.step_model
    else:
        backend.allocate_slots(6)
        random_cache(backend)
        tables, model = inputs.slots, backend.native.model
    kernel, saved = backend.native.kernel, cache_state(backend) if kv_cache_dtype else [t.clone() for t in (*backend.cache.keys, *backend.cache.values)]
    model.split_attention_bytes = model.split_heads_bytes = 0  # the tiny model's rows read a few KB: shared from any size here

    def step(shared: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        tensors = (*backend.cache.keys, *backend.cache.values, *((*backend.cache.key_scales, *backend.cache.value_scales) if kv_cache_dtype else ()))
        for tensor, old in zip(tensors, saved):
            tensor.copy_(old)
        kernel.split_here(shared)
        try:
            logits = backend.native.decode_logits(tables, inputs.positions, inputs.input_ids, inputs.kv_len)
        finally:
            kernel.split_here(None)  # back to what the thread's CPUs say
        return logits, [t.clone() for t in tensors]

    alone, alone_cache = step(False)
    calls, helped = model.split_attention_calls, kernel.helper_jobs()
    kernel.limit_caller_panels(1)
    try:
        shared, shared_cache = step(True)
    finally:
        kernel.limit_caller_panels(0)
    assert model.split_attention_calls - calls == backend.info.num_layers and kernel.helper_jobs() > helped
    assert torch.equal(shared, alone) and all(torch.equal(a, b) for a, b in zip(shared_cache, alone_cache))
