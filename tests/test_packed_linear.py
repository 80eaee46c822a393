"""Prepacked linear weights (the CPU default): the same products as nn.Linear, in and out of a graph."""

import ctypes
import functools
import mmap
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import reference, tiny_model
from polling import wait_for
from test_backend import PROMPTS, run_batch

from disagg.engine.backends import load_backend
from disagg.engine.cpu_kernels import packed_linear, small_gemm
from disagg.engine.cpu_kernels.packed_linear import PackedLinear, can_prepack, prepack_linears

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
    for shape in [(1, 96), (1, 1, 96), (2, 96), (3, 1, 96), (5, 7, 96), (64, 96), (100, 96), (packed_linear.DERIVED_MIN_ROWS, 96)]:
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


@pytest.mark.parametrize("wrong_rows", [1, 4, 65])
def test_prepacked_linears_that_change_the_logits_are_refused_at_start_up(monkeypatch, wrong_rows):
    from disagg.engine.backends.architectures import UnsupportedModel

    right = packed_linear.packed_product
    # A product that is wrong for one row count only: the start-up check tries every path (1, a few, over 64 rows).
    monkeypatch.setattr(packed_linear, "packed_product", lambda rows, *weights: right(rows, *weights) * (1.5 if rows.shape[0] == wrong_rows else 1.0))
    with pytest.raises(UnsupportedModel, match="logits change with prepacked linear layers"):
        load_backend("torch", model=tiny_model("llama"), dtype="float32", max_seq_len=128)


@pytest.fixture
def one_thread(one_torch_thread):
    """The kernel serves a backend built on one torch thread (the workers' default here)."""


needs_kernel = pytest.mark.skipif(small_gemm.kernel() is None, reason="no AVX2 CPU or C compiler: the few-row kernel is not built here")


@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features, in_features", [(160, 96), (50, 600), (24, 256), (1, 7)])
def test_the_few_row_kernel_equals_nn_linear(out_features, in_features, bias):
    # Shapes across its edges: a last panel narrower than 24 columns, K over one 256-row chunk, one output.
    torch.manual_seed(0)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    kernel = small_gemm.kernel()
    panels = kernel.pack(linear.weight.detach())
    assert panels.shape == (-(-out_features // 24), in_features, 24)
    for rows in [1, 2, 3, 4, 5, 8, 13, 64]:
        x = torch.randn(rows, in_features)
        want = linear(x).detach()
        got = kernel.product(x, panels, out_features, None if linear.bias is None else linear.bias.detach())
        assert got.shape == want.shape
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), rows


FLOAT32_BUILDS = ["float32", "float32-avx512"]


def build_or_skip(name: str) -> small_gemm.SmallGemm:
    """One kernel build by name, or the test skipped with the reason it cannot run here."""
    kernel = small_gemm.build_kernel(name)
    if kernel is None:
        needs = [feature for feature in small_gemm.BUILDS[name][2] if feature not in small_gemm.cpu_flags()]
        pytest.skip(f"{name} does not run here: " + (f"the CPU lacks {', '.join(needs)}" if needs else "no AVX2 CPU or C compiler"))
    return kernel


@needs_kernel
@pytest.mark.parametrize("build", FLOAT32_BUILDS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features, in_features", [(160, 96), (97, 600), (50, 7), (1, 300), (24, 256)])
def test_each_float32_build_equals_torch_s_product_and_the_avx2_build_s_bits(out_features, in_features, bias, build):
    """Each float32 build, forced by name, for 1 to 64 rows: 97 outputs are 5 panels (two pairs for the
    avx512 build's blocks of 16 rows or more, then a last narrow panel alone), 50 are 3 (a pair and a
    half-empty one); K of 600 spans three chunks. Every build sums each column in the same order: the same bits."""
    kernel, avx2 = build_or_skip(build), small_gemm.build_kernel("float32")
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features)
    bias_values = torch.randn(out_features) if bias else None
    panels = kernel.pack(weight)
    assert torch.equal(panels, avx2.pack(weight)) and kernel.layout == "float32"  # the one layout, whichever build reads it
    for rows in [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 63, 64]:
        x = torch.randn(rows, in_features)
        want = torch.nn.functional.linear(x, weight, bias_values)
        got = kernel.product(x, panels, out_features, bias_values)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), rows
        assert torch.equal(got, avx2.product(x, panels, out_features, bias_values)), rows


@needs_kernel
@pytest.mark.parametrize("build, avx2_build", [("float32-avx512", "float32"), ("bf16-widen-avx512", "bf16-widen")])
def test_the_avx512_float32_blocks_give_the_same_bits_whichever_rows_they_pair_panels_from(build, avx2_build):
    """Where the AVX-512 float32 blocks read two panels at a time is measured at first use (small_gemm.PAIR_FROM:
    from 2 rows or from 16, the faster here); either way each column is the same chain of FMAs, so the AVX2
    build's bits, at every row count, with a last panel left without a partner (97 outputs: 5 panels)."""
    kernel, avx2 = build_or_skip(build), small_gemm.build_kernel(avx2_build)
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(97, 600, generator=generator).to(kernel.weight_dtype)
    bias = torch.randn(97, generator=generator)
    panels = kernel.pack(weight)
    xs = {rows: torch.randn(rows, 600, generator=generator) for rows in (1, 2, 3, 4, 7, 8, 9, 15, 16, 17, 33, 64)}
    want = {rows: avx2.product(x, panels, 97, bias) for rows, x in xs.items()}
    try:
        for pair_from in small_gemm.PAIR_FROM:
            kernel.pair_from(pair_from)
            for rows, x in xs.items():
                assert torch.equal(kernel.product(x, panels, 97, bias), want[rows]), (pair_from, rows)
    finally:
        small_gemm.choose_pairing(kernel)
    with pytest.raises(ValueError, match="does not pair"):
        avx2.pair_from(2)


@needs_kernel
@pytest.mark.parametrize("variable, value, message", [
    ("DISAGG_PAIR_FROM", "1", "DISAGG_PAIR_FROM must be a number of rows, 2 or more, not '1'"),
    ("DISAGG_F32_KERNEL", "sse", "DISAGG_F32_KERNEL must be avx512 or avx2, not 'sse'"),
])
def test_a_kernel_setting_no_build_takes_ends_a_workers_start_up_in_one_line(variable, value, message):
    """A worker started with a kernel variable holding a value no build takes exits with status 2 and one line
    naming the variable and its value, as for a flag, not a traceback."""
    if variable == "DISAGG_PAIR_FROM" and small_gemm.build_kernel("float32-avx512") is None:
        pytest.skip("no AVX-512 float32 build here: nothing reads DISAGG_PAIR_FROM")
    command = [sys.executable, "-m", "decode_worker", "--model", tiny_model("llama"), "--port", "0", "--metrics-port", "-1", "--dtype", "float32"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, variable: value})
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr.strip().splitlines()[-1] == f"decode_worker: {message}"
    assert "Traceback" not in run.stderr


@pytest.fixture(params=["avx2", "avx512"])
def f32_kernel(request, monkeypatch):
    """kernel(torch.float32) as DISAGG_F32_KERNEL names it (skipped where that build cannot run)."""
    name = {"avx2": "float32", "avx512": "float32-avx512"}[request.param]
    build_or_skip(name)
    monkeypatch.setenv("DISAGG_F32_KERNEL", request.param)
    small_gemm._kernel.cache_clear()
    yield name
    small_gemm._kernel.cache_clear()


@needs_kernel
def test_the_f32_variable_names_the_float32_build(f32_kernel, caplog):
    with caplog.at_level("INFO", logger=small_gemm.__name__):
        assert small_gemm.kernel(torch.float32).name == f32_kernel
    assert f"float32 products: the {f32_kernel} kernel (DISAGG_F32_KERNEL)" in caplog.text


@needs_kernel
def test_a_float32_build_is_chosen_by_a_measured_product_unless_the_cpu_runs_only_avx2(monkeypatch, caplog):
    monkeypatch.delenv("DISAGG_F32_KERNEL", raising=False)
    small_gemm._kernel.cache_clear()
    try:
        with caplog.at_level("INFO", logger=small_gemm.__name__):
            chosen = small_gemm.kernel(torch.float32)
        if small_gemm.build_kernel("float32-avx512") is not None:  # both ran: each one's time logged
            assert f"float32 products: the {chosen.name} kernel, faster here (float32-avx512 " in caplog.text and ", float32 " in caplog.text
        # Without AVX-512F/VL: the AVX2 build, no measurement.
        monkeypatch.setattr(small_gemm, "cpu_flags", lambda: {"avx2", "fma"})
        small_gemm._kernel.cache_clear(), small_gemm._int8_kernel.cache_clear(), small_gemm.build_kernel.cache_clear()
        caplog.clear()
        with caplog.at_level("INFO", logger=small_gemm.__name__):
            assert small_gemm.kernel(torch.float32).name == "float32"
        assert "the CPU lacks avx512f, avx512vl" in caplog.text and "float32 products: the float32 kernel (the only one this CPU runs)" in caplog.text
        monkeypatch.setenv("DISAGG_F32_KERNEL", "avx-512")
        small_gemm._kernel.cache_clear()
        with pytest.raises(ValueError, match="DISAGG_F32_KERNEL must be avx512 or avx2"):
            small_gemm.kernel(torch.float32)
    finally:
        monkeypatch.undo()
        small_gemm._kernel.cache_clear(), small_gemm._int8_kernel.cache_clear(), small_gemm.build_kernel.cache_clear()


@needs_kernel
@pytest.mark.parametrize("name", ["llama", "qwen2"])  # qwen2: q, k and v biases
def test_the_float32_native_step_on_each_build_equals_transformers_step(name, f32_kernel, one_thread):
    """The native step calls the chosen build through its function pointers: transformers' step within tolerance on either."""
    from test_native_step import both_steps, random_cache, step_inputs

    backend = load_backend("torch", model=tiny_model(name), dtype="float32")
    backend.allocate_slots(40)
    assert backend.native is not None
    random_cache(backend)
    for slots in ([0, 3, 4, 5], list(range(1, 21))):  # 20 rows: the avx512 build's pairs of panels
        inputs = step_inputs(slots, [(7 * slot) % 30 for slot in slots], [slot % 50 for slot in slots])
        reference, _, native, _ = both_steps(backend, inputs)
        torch.testing.assert_close(native, reference, rtol=1e-4, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("build", ["bf16-widen", "bf16-widen-avx512", "bf16-dot"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_features, in_features", [(160, 96), (50, 600), (1, 7), (30, 258)])
def test_the_bf16_weight_kernels_compute_their_exact_products(out_features, in_features, bias, build):
    """widen: bf16 panels widened exactly as read, so the product is float32's over
    weight.float(); dot: the rows rounded to bf16 as well (pairs of k per instruction).
    Either up to the order of float32 sums, and a row's bits do not depend on its batch.
    K of 7 and 258: the dot layout's padding to a multiple of 4."""
    kernel = small_gemm.build_kernel(build)
    if kernel is None:
        pytest.skip(f"{build} does not run on this CPU")
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features).to(torch.bfloat16)
    bias_values = torch.randn(out_features) if bias else None
    panels = kernel.pack(weight)
    assert panels.dtype == torch.bfloat16 and panels.shape == (-(-out_features // 24), kernel.packed_k(in_features), 24)
    assert torch.equal(kernel.unpack(panels, out_features, in_features), weight)
    x = torch.randn(13, in_features)
    rows = x.to(torch.bfloat16).double() if build == "bf16-dot" else x.double()
    want = torch.nn.functional.linear(rows, weight.double(), None if bias_values is None else bias_values.double()).float()
    got = kernel.product(x, panels, out_features, bias_values)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    for rows in [1, 2, 3, 4, 5]:
        assert torch.equal(kernel.product(x[:rows], panels, out_features, bias_values), got[:rows]), rows
    for row in range(13):  # 13 rows: the dot build reads its panels in pairs, a row alone one at a time
        assert torch.equal(kernel.product(x[row : row + 1], panels, out_features, bias_values)[0], got[row]), row
    with pytest.raises(ValueError, match="do not fit"):  # float32 panels are another build's
        kernel.product(x, small_gemm.kernel().pack(weight.float()), out_features, bias_values)
    with pytest.raises(ValueError, match="do not fit"):  # the bias is added to float32 sums
        kernel.product(x, panels, out_features, torch.randn(out_features, dtype=torch.bfloat16))


@needs_kernel
@pytest.mark.skipif(not packed_linear.can_prepack(torch.device("cpu"), torch.bfloat16), reason="oneDNN does not pack bf16 on this CPU")
def test_a_bf16_packed_linear_rounds_the_float32_product_once(one_torch_thread):
    """PackedLinear over bf16 weights (the kernel for few rows): bf16 in, bf16 out, the float32
    sum of exact products rounded once, as oneDNN's bf16 product rounds its float32 accumulators."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 50).to(torch.bfloat16)
    reference = linear.weight.detach().double(), linear.bias.detach().double()
    packed = packed_linear.PackedLinear(linear)
    assert packed.panels.dim() == 3 and packed.panels.dtype == torch.bfloat16 and packed.onednn is None
    x = torch.randn(4, 96).to(torch.bfloat16)
    got = packed(x)
    want = torch.nn.functional.linear(x.double(), *reference)
    assert got.dtype == torch.bfloat16
    # One rounding to bf16: within half a bf16 ulp (2^-8 relative) of the exact product, plus the sums' order.
    assert ((got.double() - want).abs() <= want.abs() * 2**-8 + 1e-4).all()


@needs_kernel
def test_the_few_row_kernel_refuses_shapes_its_panels_were_not_packed_for():
    kernel = small_gemm.kernel()
    panels = kernel.pack(torch.randn(50, 96))  # 3 panels: up to 72 outputs
    with pytest.raises(ValueError, match="do not fit"):
        kernel.product(torch.randn(2, 97), panels, 50, None)
    with pytest.raises(ValueError, match="do not fit"):
        kernel.product(torch.randn(2, 96), panels, 73, None)
    with pytest.raises(ValueError, match="do not fit"):
        kernel.product(torch.randn(2, 96), panels, 50, torch.randn(49))
    with pytest.raises(ValueError, match="do not fit"):
        kernel.product(torch.randn(2, 96, dtype=torch.float64), panels, 50, None)


@needs_kernel
def test_the_few_row_kernel_gives_a_row_the_same_bits_whatever_its_batch():
    torch.manual_seed(0)
    weight, bias = torch.randn(100, 600), torch.randn(100)
    kernel = small_gemm.kernel()
    panels = kernel.pack(weight)
    x = torch.randn(11, 600)
    batch = kernel.product(x, panels, 100, bias)
    for i in range(11):
        assert torch.equal(kernel.product(x[i : i + 1], panels, 100, bias)[0], batch[i]), i


def in_new_thread(body):
    """Runs body() in a thread of its own (the kernel decides per thread whether a row
    uses two cores); returns its result, raises what it raised."""
    outcome = {}

    def run():
        try:
            outcome["value"] = body()
        except BaseException as exc:  # noqa: BLE001 (re-raised below, in the test's thread)
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: a row cannot be split across two")


@pytest.fixture
def helper_computes():
    """The caller of a split product computes one panel and leaves the rest to the
    helper: it would otherwise take them all whenever the helper is slow to start."""
    kernel = small_gemm.kernel()
    kernel.limit_caller_panels(1)
    yield kernel
    kernel.limit_caller_panels(0)


@pytest.fixture
def splittable(monkeypatch, helper_computes):
    """The kernel splitting every product (the tests' weights are smaller than a
    real model's), the panels of a 160 x 96 weight, and one row for them."""
    monkeypatch.setattr(small_gemm, "SPLIT_MIN_BYTES", 0)
    kernel = small_gemm.kernel()
    return kernel, kernel.pack(torch.randn(160, 96)), torch.randn(1, 96)


@needs_kernel
@two_cpus
@pytest.mark.parametrize("out_features, in_features", [(160, 96), (50, 600), (49, 7), (24, 256)])
@pytest.mark.parametrize("caller_panels", [1, 0], ids=["helper-takes-the-rest", "as-the-threads-run"])
@pytest.mark.parametrize("build", [*FLOAT32_BUILDS, "bf16-widen-avx512", "bf16-dot"])
def test_a_product_on_two_cores_gives_the_bits_of_one_core(out_features, in_features, caller_panels, build, monkeypatch):
    # 24 outputs are one panel: nothing to share, the caller computes it alone. The avx512 builds'
    # helper claims pairs of panels (read two at a time from 2 or 16 rows, as measured at first use:
    # small_gemm.choose_pairing), as bf16-dot's does from 9 rows (dot_pair_block); a row alone reads single panels.
    monkeypatch.setattr(small_gemm, "SPLIT_MIN_BYTES", 0)  # these weights are smaller than a real model's
    monkeypatch.setattr(small_gemm, "SPLIT_MAX_ROWS", 64)  # the C side shares any number of rows
    torch.manual_seed(0)
    kernel = build_or_skip(build)
    weight, bias = torch.randn(out_features, in_features).to(kernel.weight_dtype), torch.randn(out_features)
    panels = kernel.pack(weight)

    def product(x, split: bool):
        kernel.split_here(split)
        return kernel.product(x, panels, out_features, bias)

    kernel.limit_caller_panels(caller_panels)
    try:
        for rows in (1, 3, 8, 17, 64):
            x = torch.randn(rows, in_features)
            alone = in_new_thread(lambda: product(x, False))
            before = kernel.helper_jobs()
            split = in_new_thread(lambda: product(x, True))
            assert torch.equal(split, alone), rows
            if caller_panels or out_features <= 24:  # else whether the helper got a share is the scheduler's
                assert kernel.helper_jobs() - before == (0 if out_features <= 24 else 1), rows
            for row in (0, rows // 2, rows - 1):
                assert torch.equal(in_new_thread(lambda: product(x[row : row + 1], False))[0], alone[row]), (rows, row)
            rounded = x.to(torch.bfloat16) if build == "bf16-dot" else x  # the dot build's rows are rounded to bf16
            want = torch.nn.functional.linear(rounded.double(), weight.double(), bias.double())
            assert (split.double() - want).abs().max() <= 1e-5 * want.abs().max(), rows
    finally:
        kernel.limit_caller_panels(0)


@needs_kernel
@two_cpus
def test_a_thread_pinned_to_one_cpu_keeps_its_rows_on_that_cpu(splittable):
    kernel, panels, x = splittable

    def on_one_cpu():
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # this thread only
        return kernel.splits_here(), kernel.product(x, panels, 160, None)

    before = kernel.helper_jobs()
    splits, _ = in_new_thread(on_one_cpu)
    assert not splits and kernel.helper_jobs() == before
    assert in_new_thread(kernel.splits_here)  # a thread left unpinned splits


@needs_kernel
@two_cpus
def test_the_helper_runs_on_the_cpus_of_the_thread_it_works_for(splittable):
    # A worker pins its model thread (--device-cpus) after start-up, when the helper may already exist.
    kernel, panels, x = splittable
    everywhere = os.sched_getaffinity(0)

    def split(cpus=None):
        if cpus is not None:
            os.sched_setaffinity(0, cpus)  # this thread only
        kernel.split_here(True)  # even on one CPU: the helper must then share it
        return kernel.product(x, panels, 160, None)

    want = in_new_thread(split)
    assert kernel.helper_cpus() == everywhere
    one_cpu = {max(everywhere)}
    assert torch.equal(in_new_thread(lambda: split(one_cpu)), want)
    assert kernel.helper_cpus() == one_cpu
    in_new_thread(split)
    assert kernel.helper_cpus() == everywhere


def shared_product(kernel, panels, x):
    """The splittable fixture's product, shared with the helper (on this thread)."""
    kernel.split_here(True)
    return kernel.product(x, panels, 160, None)


@needs_kernel
@two_cpus
def test_a_forked_child_splits_rows_with_a_helper_of_its_own(splittable):
    # fork copies only the calling thread: a child waiting on its parent's helper would hang.
    kernel, panels, x = splittable

    split = functools.partial(shared_product, kernel, panels, x)

    want = in_new_thread(split)  # the parent's helper is running now
    assert kernel.helper_jobs() > 0
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 if its own helper computed the same bits
        try:
            os._exit(0 if torch.equal(split(), want) and kernel.helper_jobs() == 1 else 1)
        except BaseException:  # noqa: BLE001 (a child must never return into pytest)
            os._exit(2)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung on its split product")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(done[1]) == 0


@needs_kernel
@two_cpus
def test_a_helper_asked_to_warm_weights_that_are_gone_prefetches_them_harmlessly(splittable):
    # native_step.c asks the waiting helper to warm the next product's weights; a request may outlive them.
    kernel, panels, x = splittable

    split = functools.partial(shared_product, kernel, panels, x)

    want = in_new_thread(split)  # the helper is started, and waits for the next job
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = 1 << 20
    address = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert address not in (None, ctypes.c_void_p(-1).value)
    done = kernel.warmings_done()
    kernel.warm(1, 576, address, 240)  # a one-row product of 240 outputs over 576 inputs there: its last panels, inside the region
    assert libc.munmap(address, size) == 0  # the helper prefetches addresses with nothing behind them
    # A helper that slept since the last job warms after the next one: products wake it until it has.
    wait_for(lambda: kernel.warmings_done() > done or (in_new_thread(split), False)[1], within=60, what="the helper's warming")
    assert torch.equal(in_new_thread(split), want)


@needs_kernel
@two_cpus
def test_the_helper_runs_at_the_lowest_priority(splittable):
    # SCHED_IDLE: it takes only a core nothing else wants (the prefill worker's, when it has no prompt).
    kernel, panels, x = splittable
    kernel.split_here(True)
    in_new_thread(lambda: kernel.product(x, panels, 160, None))
    assert kernel.helper_idle()


@pytest.fixture
def ten_panels_split(monkeypatch):
    """(the kernel, same_bits): same_bits(x) is whether x's product over a ten-panel weight shared with the
    helper has the bits of the product on the calling thread alone (each in a thread of its own)."""
    monkeypatch.setattr(small_gemm, "SPLIT_MIN_BYTES", 0)
    kernel = small_gemm.kernel()
    torch.manual_seed(0)
    panels = kernel.pack(torch.randn(240, 64))  # ten panels

    def product(x, split: bool):
        kernel.split_here(split)
        return kernel.product(x, panels, 240, None)

    def same_bits(x):
        return torch.equal(in_new_thread(lambda: product(x, True)), in_new_thread(lambda: product(x, False)))

    return kernel, same_bits


def late_panels_above(kernel, before: int) -> bool:
    """Whether the helper counts a late panel beyond `before` within 30 s (it counts one once it wakes)."""
    deadline = time.monotonic() + 30
    while kernel.late_panels() == before and time.monotonic() < deadline:
        time.sleep(0.05)
    return kernel.late_panels() > before


@needs_kernel
@two_cpus
def test_a_caller_takes_back_the_panels_of_a_helper_that_lost_its_core(ten_panels_split):
    """A helper asleep right after it claims a panel: the caller computes that panel
    itself and returns (the helper's late result is dropped, so it is counted late);
    products after it, with the helper asleep and then awake again, keep their bits."""
    kernel, same_bits = ten_panels_split
    late_before = kernel.late_panels()
    kernel.stall_helper(0.5)
    kernel.await_helper_claim(True)  # so that the helper surely holds a panel when it falls asleep
    try:
        assert same_bits(torch.randn(5, 64))
        kernel.await_helper_claim(False)
        assert all(same_bits(torch.randn(rows, 64)) for rows in (1, 8))  # the helper still asleep
    finally:
        kernel.await_helper_claim(False)
        kernel.stall_helper(0)
    assert late_panels_above(kernel, late_before)  # the caller did not wait for the panel the helper held
    assert all(same_bits(torch.randn(rows, 64)) for rows in (3, 64))  # the helper awake again


@needs_kernel
@two_cpus
def test_a_caller_takes_back_a_unit_its_helper_started_and_then_lost_its_core_in(ten_panels_split):
    """A helper asleep in the middle of a unit (marked started): the caller waits about a unit's time for it, then
    computes it itself and returns with the product's bits (the helper's late result is dropped, so it is counted
    late); the caller does not wait for the sleeping helper (half a second a unit) to finish."""
    kernel, same_bits = ten_panels_split
    late_before = kernel.late_panels()
    kernel.stall_started_helper(0.5)
    kernel.await_helper_claim(True)  # so that the helper surely holds a unit when it falls asleep
    try:
        assert same_bits(torch.randn(5, 64))
    finally:
        kernel.await_helper_claim(False)
        kernel.stall_started_helper(0)
    assert late_panels_above(kernel, late_before)  # the caller computed the unit the helper had started


@needs_kernel
def test_a_packed_linear_on_one_thread_uses_the_kernel_up_to_64_rows(one_thread, monkeypatch):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160)
    packed = PackedLinear(linear)
    assert packed.panels.dim() == 3 and packed.onednn is None and torch.equal(packed.weight, linear.weight)  # one layout
    calls = []
    kernel = small_gemm.kernel()
    monkeypatch.setattr(kernel, "product", lambda *args, **kw: calls.append(args[0].shape[0]) or type(kernel).product(kernel, *args, **kw))
    derived, reordered = [], []
    real_linear, reorder = packed_linear.F.linear, torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(packed_linear.F, "linear", lambda x, w, b=None: derived.append((x.shape[0], tuple(w.shape), w.dtype)) or real_linear(x, w, b))
    monkeypatch.setattr(packed_linear.torch.ops.mkldnn, "_reorder_linear_weight", lambda *args: reordered.append(args[0].shape) or reorder(*args))
    shares = kernel.splits_here()
    try:
        kernel.split_here(False)
        for rows in (1, 8, 64, 65, packed_linear.DERIVED_MIN_ROWS):
            x = torch.randn(rows, 96)
            torch.testing.assert_close(packed(x), real_linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
        assert calls == [1, 8, 64, 64, 1] and derived == [(packed_linear.DERIVED_MIN_ROWS, (160, 96), torch.float32)] and reordered == []
        bf16 = PackedLinear(torch.nn.Linear(96, 160).to(torch.bfloat16)) if can_prepack(CPU, torch.bfloat16) else None
        if bf16 is not None and bf16.panels is not None:  # bf16 rows: oneDNN over its layout derived from the panels
            derived.clear(), calls.clear()
            bf16(torch.randn(packed_linear.DERIVED_MIN_ROWS, 96).to(torch.bfloat16))
            assert reordered == [(160, 96)] and derived == []
    finally:
        kernel.split_here(shares)
    # 65 rows (a short prefill's) in blocks of 64 through the kernel; from DERIVED_MIN_ROWS, float32 rows go to MKL over
    # the float32 weight derived from the panels.


@needs_kernel
@two_cpus
def test_a_prefill_s_rows_go_through_the_kernel_in_shared_blocks_of_64(one_thread, monkeypatch, helper_computes):
    """Where the kernel shares a weight with its helper, a prefill's 65 or more rows (up to
    SHARED_DERIVED_MIN_ROWS) are blocks of 64 through it (each on two cores), with each row's
    bits as 64 rows alone give."""
    monkeypatch.setattr(small_gemm, "SPLIT_MIN_BYTES", 0)  # the test's weight is smaller than a real model's
    monkeypatch.setattr(packed_linear, "SHARED_DERIVED_MIN_ROWS", 1000)  # blocks, not MKL (the next test)
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160)
    packed = PackedLinear(linear)
    kernel = helper_computes
    x = torch.randn(150, 96)
    calls = []
    monkeypatch.setattr(kernel, "product", lambda *args, **kw: calls.append(args[0].shape[0]) or type(kernel).product(kernel, *args, **kw))
    shares = kernel.splits_here()
    try:
        kernel.split_here(True)
        jobs_before = kernel.helper_jobs()
        got = packed(x)
        assert calls == [64, 64, 22] and kernel.helper_jobs() - jobs_before == 3  # the helper computed part of each
        kernel.split_here(False)
        alone = torch.cat([packed(block) for block in x.split(64)])
        assert torch.equal(got, alone)
        torch.testing.assert_close(got, linear(x), rtol=1e-5, atol=1e-5)
        calls.clear()
        packed(x)  # a thread that does not share: the same blocks, on its own core
        assert calls == [64, 64, 22]
    finally:
        kernel.split_here(shares)


@needs_kernel
@two_cpus
@pytest.mark.parametrize("method", [None, "int8"])
def test_a_long_float32_prefill_s_shared_products_go_to_mkl_over_the_derived_weight(one_thread, monkeypatch, method):
    """From SHARED_DERIVED_MIN_ROWS float32 rows, a product the kernel would share with its helper is
    F.linear over the float32 weight unpacked from the panels (an 8-bit one's dequantized values), not
    the kernel's blocks; with fewer rows the blocks stay, and a caller of one core keeps them up to
    DERIVED_MIN_ROWS."""
    from disagg.engine.quantization.schemes import quantize

    monkeypatch.setattr(small_gemm, "SPLIT_MIN_BYTES", 0)  # the test's weight is smaller than a real model's
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 160)
    quantized = None
    if method is not None:
        quantized = quantize(linear.weight, method)
        with torch.no_grad():
            linear.weight.copy_(quantized.dequantized(torch.float32))
    packed = PackedLinear(linear, quantized=quantized)
    kernel = small_gemm.kernel(packed.panels.dtype)
    products, linears = [], []
    monkeypatch.setattr(kernel, "product", lambda *args, **kw: products.append(args[0].shape[0]) or type(kernel).product(kernel, *args, **kw))
    real_linear = packed_linear.F.linear
    monkeypatch.setattr(packed_linear.F, "linear", lambda x, w, b=None: linears.append((x.shape[0], tuple(w.shape), w.dtype)) or real_linear(x, w, b))
    shares = kernel.splits_here()
    try:
        kernel.split_here(True)
        rows = packed_linear.SHARED_DERIVED_MIN_ROWS
        x = torch.randn(rows, 96)
        torch.testing.assert_close(packed(x), real_linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
        assert products == [] and linears == [(rows, (160, 96), torch.float32)]
        linears.clear()
        packed(x[: rows - 1])  # one row fewer: the kernel's blocks
        assert linears == [] and products == [64] * ((rows - 1) // 64) + ([(rows - 1) % 64] if (rows - 1) % 64 else [])
        products.clear()
        kernel.split_here(False)
        packed(x)  # a caller of one core: the kernel's blocks below DERIVED_MIN_ROWS, MKL from there
        assert linears == [] and products
        products.clear()
        x = torch.randn(packed_linear.DERIVED_MIN_ROWS, 96)
        torch.testing.assert_close(packed(x), real_linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
        assert products == [] and linears == [(packed_linear.DERIVED_MIN_ROWS, (160, 96), torch.float32)]
    finally:
        kernel.split_here(shares)


def test_without_a_c_compiler_the_linears_keep_onednn_s_layout_alone(one_thread, monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("DISAGG_CACHE", str(tmp_path))
    small_gemm._kernel.cache_clear(), small_gemm._int8_kernel.cache_clear(), small_gemm.build_kernel.cache_clear()
    try:
        assert small_gemm.kernel() is None
        linear = torch.nn.Linear(96, 160)
        packed = PackedLinear(linear)
        assert packed.panels is None and packed.onednn is not None  # one layout: oneDNN's
        for rows in (1, 8, 100):
            x = torch.randn(rows, 96)
            torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    finally:
        small_gemm._kernel.cache_clear(), small_gemm._int8_kernel.cache_clear(), small_gemm.build_kernel.cache_clear()


@needs_kernel
@pytest.mark.parametrize("split_rows", [False, True], ids=["one-core", "single-rows-on-two-cores"])
def test_the_backend_on_one_thread_decodes_as_generate_through_the_kernel(one_thread, split_rows, monkeypatch, helper_computes):
    # The tiny model's weights are below the size a row is split from: set it either way.
    monkeypatch.setattr(small_gemm, "SPLIT_MIN_BYTES", 0 if split_rows else 1 << 62)
    jobs_before = small_gemm.kernel().helper_jobs()
    ref = reference("llama")
    backend = load_backend("torch", model=tiny_model("llama"), dtype="float32", max_seq_len=128)
    assert all(m.panels is not None and m.onednn is None for m in backend.model.modules() if isinstance(m, PackedLinear))
    for layer in backend.model.model.layers:  # q, k and v are one product, and gate and up another
        attention, mlp = layer.self_attn, layer.mlp
        assert attention.q_proj.shared is attention.k_proj.shared is attention.v_proj.shared is not None
        assert mlp.gate_proj.shared is mlp.up_proj.shared is not None
        assert attention.o_proj.shared is mlp.down_proj.shared is None
    backend.allocate_slots(4)
    max_new = [5, 9, 13, 21]
    out, _, _ = run_batch(backend, ref, PROMPTS, max_new, async_mode=True)
    for i, prompt in enumerate(PROMPTS):
        assert out[str(i)] == ref.greedy(prompt, max_new[i]), prompt
    # The last steps decode one row (the longest request alone): shared where the device thread may use two CPUs.
    assert (small_gemm.kernel().helper_jobs() > jobs_before) == (split_rows and len(os.sched_getaffinity(0)) > 1)


class ThreeHeads(torch.nn.Module):
    """q, k and v read the same input, as in an attention; `out` reads another."""

    def __init__(self, bias_of_k: bool):
        super().__init__()
        self.q, self.k, self.v = torch.nn.Linear(96, 50), torch.nn.Linear(96, 24, bias=bias_of_k), torch.nn.Linear(96, 7, bias=False)
        self.out = torch.nn.Linear(81, 96)

    def forward(self, x):
        return self.out(torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1))


@needs_kernel
@pytest.mark.parametrize("bias_of_k", [False, True])
def test_linears_on_the_same_input_are_one_product_with_each_members_own_bits(one_thread, bias_of_k, monkeypatch):
    torch.manual_seed(0)
    model = ThreeHeads(bias_of_k)
    prepack_linears(model)
    names = ("q", "k", "v")
    kernel = small_gemm.kernel()
    product = kernel.product

    def alone(name, x):  # the member's own product, over its own panels
        linear = getattr(model, name)
        return product(x.reshape(-1, 96), linear.panels, linear.out_features, linear.bias).reshape(*x.shape[:-1], -1)

    inputs = [torch.randn(1, 96), torch.randn(1, 1, 96), torch.randn(5, 96)]
    with torch.inference_mode():
        want = [{name: alone(name, x) for name in names} for x in inputs]
        assert packed_linear.group_shared_inputs(model, lambda: model(inputs[0])) == 1
        group = model.q.shared
        assert group is model.k.shared is model.v.shared and model.out.shared is None
        # The members' panels are views of the group's: the weights are not held twice.
        assert {getattr(model, name).panels.untyped_storage().data_ptr() for name in names} == {group.panels.untyped_storage().data_ptr()}
        products = []
        monkeypatch.setattr(kernel, "product", lambda rows, panels, *rest: products.append(panels.shape[0]) or product(rows, panels, *rest))
        for x, expected in zip(inputs, want):
            for name in names:
                assert torch.equal(getattr(model, name)(x), expected[name]), name
        # A single row: one product of the whole group (3 + 1 + 1 panels); more rows: one a member.
        assert products == [5, 5, 3, 1, 1]
        # Equal values in another tensor: the group's product is computed anew.
        assert torch.equal(model.k(inputs[0].clone()), want[0]["k"]) and products[5:] == [5]
        # A member called again on the tensor it took its slice of (a buffer the model refills
        # in place, under inference mode, would look the same): computed anew.
        x = inputs[1]
        assert torch.equal(model.q(x), want[1]["q"]) and torch.equal(model.q(x), want[1]["q"]) and products[6:] == [5, 5]
        assert torch.equal(model.k(x), want[1]["k"]) and torch.equal(model.v(x), want[1]["v"]) and products[8:] == []
    # Outside inference mode a tensor counts its in-place changes: a member sees the change.
    x = torch.randn(1, 96)
    with torch.no_grad():
        model.q(x)
        x.mul_(2)
        assert torch.equal(model.k(x), alone("k", x)) and products[8:] == [5, 5]  # q's product, then k's anew


def test_after_packing_the_weights_left_as_loaded_no_longer_hold_the_loaders_buffer():
    """A kept tensor (an embedding, a norm) built over one large loader buffer holds all of it; after
    packing each has a storage of its own, a tensor two modules share stays shared, and the logits are unchanged."""
    import gc
    import weakref

    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 64)).eval()
    buffer = torch.randn(64 * 32 + 32 + 32 + 64 * 32 + 64 + 10_000)  # one slab, as a loader makes, larger than what is kept
    with torch.no_grad():
        embedding, norm = buffer[: 64 * 32].view(64, 32), buffer[64 * 32 : 64 * 32 + 32]
        model[0].weight = torch.nn.Parameter(embedding)
        model[1].weight = torch.nn.Parameter(norm)
        model[1].bias = model[1].weight  # two names for one tensor
    slab = weakref.ref(buffer.untyped_storage())
    ids = torch.tensor([[5, 9, 14, 3]])
    with torch.inference_mode():
        want = model(ids)
    del buffer, embedding, norm
    assert slab() is not None  # held through the kept views
    assert prepack_linears(model) == 1
    gc.collect()
    assert slab() is None  # nothing holds the loader's slab any more
    assert model[1].bias is model[1].weight
    with torch.inference_mode():
        torch.testing.assert_close(model(ids), want, rtol=1e-5, atol=1e-5)
