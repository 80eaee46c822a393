"""The torch backend and the decode loop in one process, against transformers generate()."""

import threading
import time
from types import SimpleNamespace

import pytest
from conftest import ARCHITECTURES, reference, tiny_model

from decode_worker.decode_loop import DecodeLoop, Sequence
from disagg.engine.backends import load_backend
from disagg.engine.cpu_kernels import small_gemm
from disagg.engine.requests import FinishReason, Sampling, Stopping
from disagg.kv_transport.chunk_codec import KvKind

PROMPTS = ["The baker opens", "Our café on the corner serves", "Snow fell", "A river runs through the old town. Seven bridges"]


def prefill_into_slot(backend, ids: list[int], slot: int, sampling: Sampling):
    """Prefills the prompt and copies its KV into the slot, as a decode worker receives it."""
    result = backend.prefill(ids, sampling)
    for layer, (k, v) in enumerate(result.layers):
        backend.write_kv([slot], layer, KvKind.KEY, 0, k)
        backend.write_kv([slot], layer, KvKind.VALUE, 0, v)
    return result


def run_batch(backend, ref, prompts, max_new, async_mode, slots=None):
    """Prefills each prompt, copies its KV into a slot, decodes all together."""
    out, finished, retired = {}, {}, []
    done = threading.Event()

    def publish(events):
        for e in events:
            out[e.key] += e.token_ids
            if e.finish is not FinishReason.NONE:
                finished[e.key] = e.finish

    def on_retired(keys):
        retired.extend(keys)
        if len(retired) == len(prompts):
            done.set()

    decode_loop = DecodeLoop(backend, publish, on_retired, async_mode=async_mode)
    decode_loop.start()
    for i, prompt in enumerate(prompts):
        ids = ref.ids(prompt)
        slot = slots[i] if slots else i
        result = prefill_into_slot(backend, ids, slot, Sampling())
        out[str(i)] = [result.first_token]
        decode_loop.admit(Sequence(str(i), slot, len(ids), result.first_token, Sampling(), Stopping(max_new[i], frozenset([ref.eos]))))
    assert done.wait(60), "batch did not finish"
    decode_loop.stop()
    return out, finished, decode_loop.stats


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("async_mode", [True, False], ids=["async", "sync"])
def test_batched_greedy_decode_equals_generate(architecture, async_mode):
    ref = reference(architecture)
    backend = load_backend("torch", model=tiny_model(architecture), dtype="float32")
    backend.allocate_slots(6)
    max_new = [6, 11, 17, 23]
    # Slots 1, 4, 2, 5: not contiguous, so the gather path runs as well as the view path.
    out, finished, _ = run_batch(backend, ref, PROMPTS, max_new, async_mode, slots=[1, 4, 2, 5])
    for i, prompt in enumerate(PROMPTS):
        expected = ref.greedy(prompt, max_new[i])
        assert out[str(i)] == expected, prompt
        assert finished[str(i)] == (FinishReason.STOP if expected[-1] == ref.eos else FinishReason.LENGTH)


@pytest.mark.parametrize("architecture", ["llama", "mistral-sw", "gemma2-sw"])
def test_paged_greedy_decode_equals_generate(architecture):
    """KV in blocks of 4 positions, each sequence's table scattered over the cache (the native
    step, the in-place kernel or transformers' modules, as each model is served)."""
    ref = reference(architecture)
    backend = load_backend("torch", model=tiny_model(architecture), dtype="float32")
    backend.allocate_slots(4, num_blocks=80, block_size=4)
    max_new = [6, 11, 17, 23]
    tables = [list(range(79 - i, 0, -4)) for i in range(4)]  # row i: blocks 79 - i, 75 - i, ...: interleaved, descending
    out, retired = {}, []
    done = threading.Event()

    def publish(events):
        for e in events:
            out[e.key] += e.token_ids

    decode_loop = DecodeLoop(backend, publish, lambda keys: retired.extend(keys) or (len(retired) == 4 and done.set()), async_mode=True)
    decode_loop.start()
    for i, prompt in enumerate(PROMPTS):
        ids = ref.ids(prompt)
        result = backend.prefill(ids, Sampling())
        for layer, (k, v) in enumerate(result.layers):
            backend.write_kv(tables[i], layer, KvKind.KEY, 0, k)
            backend.write_kv(tables[i], layer, KvKind.VALUE, 0, v)
        out[str(i)] = [result.first_token]
        decode_loop.admit(Sequence(str(i), i, len(ids), result.first_token, Sampling(), Stopping(max_new[i], frozenset([ref.eos])), table=tuple(tables[i])))
    assert done.wait(60), "batch did not finish"
    decode_loop.stop()
    for i, prompt in enumerate(PROMPTS):
        assert out[str(i)] == ref.greedy(prompt, max_new[i]), prompt


def test_async_mode_drops_exactly_the_extra_tokens_after_eos():
    ref = reference("llama")
    backend = load_backend("torch", model=tiny_model("llama"), dtype="float32")
    backend.allocate_slots(2)
    prompt = "The farmer counted his sheep at sunset: one, two, three, four, five, six, seven, eight, nine, ten. All of them"
    expected = ref.greedy(prompt, 40)
    assert expected[-1] == ref.eos and len(expected) < 40, "the prompt must end in EOS for this test"
    out, finished, stats = run_batch(backend, ref, [prompt], [40], async_mode=True)
    assert out["0"] == expected and finished["0"] is FinishReason.STOP
    assert stats.dropped_tokens == 1  # one async step past EOS, never more


def test_a_steps_tokens_are_published_once_the_next_step_has_launched_into_native_step_c():
    """Async mode: the host work of step k (its tokens out) starts only once step k+1 has made its one
    call into native_step.c, so that the loop's and the event loop's Python never hold k+1 back at the GIL."""
    if small_gemm.kernel() is None:
        pytest.skip("the native step needs an AVX2 CPU and a C compiler")
    ref = reference("llama")
    backend = load_backend("torch", model=tiny_model("llama"), dtype="float32")
    backend.allocate_slots(2)
    assert backend.native is not None and backend.signals_launch, "the llama float32 step must run natively on CPU"
    order, steps, inside, done = [], iter(range(1000)), threading.local(), threading.Event()

    def decode_step(inputs):
        number, launch = next(steps), inputs.on_launch

        def launched():  # the backend's call, inside its decode_step, then the decode loop's own once the step ends
            if not any(what == "launched" and n == number for what, n, _ in order):
                order.append(("launched", number, getattr(inside, "step", None) == number))
            launch()

        inputs.on_launch, inside.step = launched, number
        try:
            return backend.decode_step(inputs)
        finally:
            inside.step = None

    published = iter(range(1000))
    decode_loop = DecodeLoop(backend, lambda events: order.append(("published", next(published), None)), lambda keys: done.set(), decode_step=decode_step)
    decode_loop.start()
    ids = ref.ids(PROMPTS[0])
    result = prefill_into_slot(backend, ids, 0, Sampling())
    decode_loop.admit(Sequence("0", 0, len(ids), result.first_token, Sampling(), Stopping(12)))
    assert done.wait(60)
    decode_loop.stop()
    launches = [(number, by_backend) for what, number, by_backend in order if what == "launched"]
    assert [number for number, _ in launches] == list(range(11)) and all(by_backend for _, by_backend in launches), order
    for k in range(10):  # step k's tokens out only after step k+1 launched (step 10, the last, has no next)
        assert order.index(("launched", k + 1, True)) < order.index(("published", k, None)), order


def test_other_device_work_queued_ahead_of_the_next_step_does_not_hold_back_the_steps_tokens():
    """Work run on the device thread between steps (run_on_device: a colocated prefill) that lands ahead of
    step k+1: step k's tokens still go out while it runs, not once k+1 launches behind it."""
    ref = reference("llama")
    backend = load_backend("torch", model=tiny_model("llama"), dtype="float32")
    backend.allocate_slots(2)
    out, done, release, steps, other = [], threading.Event(), threading.Event(), iter(range(1000)), []

    def decode_step(inputs):
        if next(steps) == 3:  # before step 3 launches the loop is waiting for it: step 4 is not submitted yet
            other.append(decode_loop.run_on_device(release.wait))
        return backend.decode_step(inputs)

    decode_loop = DecodeLoop(backend, lambda events: out.extend(t for e in events for t in e.token_ids), lambda keys: done.set(), decode_step=decode_step)
    decode_loop.start()
    ids = ref.ids(PROMPTS[0])
    result = prefill_into_slot(backend, ids, 0, Sampling())
    decode_loop.admit(Sequence("0", 0, len(ids), result.first_token, Sampling(), Stopping(12)))
    try:
        wait_until(lambda: len(out) >= 4, "step 3's token waited for the work queued behind it")  # steps 0-3 out while the work holds the device
        assert not other[0].done()
    finally:
        release.set()  # a failed wait leaves no device thread held
    assert done.wait(60)
    decode_loop.stop()
    assert [result.first_token, *out] == ref.greedy(PROMPTS[0], 12, ignore_eos=True)


def test_bf16_is_the_default_and_allocates_the_slot_cache_once():
    backend = load_backend("torch", model=tiny_model("llama"))
    assert backend.info.dtype == "bfloat16"
    info = backend.info
    size = backend.allocate_slots(3)
    assert size == 2 * info.num_layers * 3 * info.kv_heads * info.max_seq_len * info.head_dim * 2


@pytest.mark.parametrize("async_mode", [True, False], ids=["async", "sync"])
def test_penalties_and_logprobs_in_a_batch_equal_transformers_with_the_same_processing(async_mode):
    """Prefill samples the first token, the decode loop the rest, next to unpenalized rows
    (the per-slot counts are set on admission and updated on the device each step)."""
    import torch
    from test_sampling_e2e import reference_run

    ref = reference("llama")
    backend = load_backend("torch", model=tiny_model("llama"), dtype="float32")
    backend.allocate_slots(4)
    penalized = Sampling(repetition_penalty=1.5, presence_penalty=-0.5, frequency_penalty=2.0, logprobs=3)
    rows = [("The cat slept", penalized), ("Snow fell", Sampling()), ("At night", penalized)]
    out, logprobs, retired, done = {}, {}, [], threading.Event()

    def publish(events):
        for e in events:
            out[e.key] += e.token_ids
            logprobs[e.key] += e.logprobs or []

    def on_retired(keys):
        retired.extend(keys)
        if len(retired) == len(rows):
            done.set()

    decode_loop = DecodeLoop(backend, publish, on_retired, async_mode=async_mode)
    decode_loop.start()
    for slot, (prompt, sampling) in enumerate(rows):
        ids = ref.ids(prompt)
        result = prefill_into_slot(backend, ids, slot, sampling)
        out[str(slot)], logprobs[str(slot)] = [result.first_token], [result.logprobs] if result.logprobs else []
        decode_loop.admit(Sequence(str(slot), slot, len(ids), result.first_token, sampling, Stopping(16 + slot), context_ids=tuple(ids)))
    assert done.wait(60)
    decode_loop.stop()
    for slot, (prompt, sampling) in enumerate(rows):
        if sampling.penalized:
            expected, scores = reference_run(ref, ref.ids(prompt), repetition=1.5, presence=-0.5, frequency=2.0, max_new_tokens=16 + slot)
            assert out[str(slot)] == expected, prompt
            for token, got, step in zip(expected, logprobs[str(slot)], scores, strict=True):
                values, top = step.log_softmax(-1).topk(3)
                assert got.token_id == token and got.logprob == pytest.approx(values[0].item(), abs=1e-4)
                assert [t for t, _ in got.top] == top.tolist() and torch.allclose(torch.tensor([v for _, v in got.top]), values, atol=1e-4)
        else:
            assert out[str(slot)] == ref.greedy(prompt, 16 + slot, ignore_eos=True) and logprobs[str(slot)] == []


def held_decode_loop(prompts: list[str]) -> SimpleNamespace:
    """An async decode loop (not started) over the prompts' KV, one slot each, whose
    device thread is held until `release` is set, so that steps queue behind it.
    `batches` gets one {key: tokens} per published step; `done` is set once every
    request is retired; `sequence(slot, max_new)` is request `slot`'s row."""
    ref = reference("llama")
    backend = load_backend("torch", model=tiny_model("llama"), dtype="float32")
    backend.allocate_slots(len(prompts))
    held = SimpleNamespace(ref=ref, batches=[], retired=[], done=threading.Event(), release=threading.Event())

    def on_retired(keys):
        held.retired.extend(keys)
        if len(held.retired) == len(prompts):
            held.done.set()

    held.decode_loop = DecodeLoop(backend, lambda events: held.batches.append({e.key: e.token_ids for e in events}), on_retired, async_mode=True)
    held.first = [prefill_into_slot(backend, ref.ids(prompt), slot, Sampling()).first_token for slot, prompt in enumerate(prompts)]
    held.sequence = lambda slot, max_new: Sequence(str(slot), slot, len(ref.ids(prompts[slot])), held.first[slot], Sampling(), Stopping(max_new))
    held.decoded = lambda slot: [held.first[slot]] + [t for batch in held.batches for t in batch.get(str(slot), [])]
    held.decode_loop.run_on_device(held.release.wait)
    return held


def wait_until(condition, failure: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, failure
        time.sleep(0.01)


def steps_queued(decode_loop: DecodeLoop) -> int:
    """Work waiting on the device thread behind what runs there."""
    return decode_loop._device._work_queue.qsize()


def test_a_request_admitted_while_a_step_runs_joins_the_next_step():
    """Async mode submits step k+1 while step k runs. A request admitted meanwhile
    must still join k+1 (k+1 is rebuilt before it starts), not wait for k+2: its
    first decoded token comes out beside the running request's second one."""
    prompts, max_new = ["The baker opens", "Snow fell"], [8, 6]
    held = held_decode_loop(prompts)
    held.decode_loop.start()
    held.decode_loop.admit(held.sequence(0, max_new[0]))
    wait_until(lambda: steps_queued(held.decode_loop) == 2, "the decode loop did not submit steps 1 and 2 of request 0")
    held.decode_loop.admit(held.sequence(1, max_new[1]))
    wait_until(lambda: held.decode_loop.stats.rebuilt_steps == 1, "step 2 was not rebuilt with the new request")
    held.release.set()
    assert held.done.wait(60)
    held.decode_loop.stop()
    assert list(held.batches[0]) == ["0"]  # step 1: request 0 alone
    assert set(held.batches[1]) == {"0", "1"}  # step 2: request 1's first decode step
    for slot, prompt in enumerate(prompts):
        assert held.decoded(slot) == held.ref.greedy(prompt, max_new[slot], ignore_eos=True), prompt


def test_a_request_evicted_while_a_step_runs_leaves_the_next_step():
    """The same rebuild for an eviction: the evicted row leaves step k+1 before it
    runs, its slot is handed back, and the other row decodes as generate()."""
    prompts, max_new = ["The baker opens", "Snow fell"], [8, 20]
    held = held_decode_loop(prompts)
    for slot in range(2):  # both in the inbox before the loop starts: step 1 has both rows
        held.decode_loop.admit(held.sequence(slot, max_new[slot]))
    held.decode_loop.start()
    wait_until(lambda: steps_queued(held.decode_loop) == 2, "the decode loop did not submit steps 1 and 2, both rows in each")
    held.decode_loop.evict("1")
    wait_until(lambda: held.decode_loop.stats.rebuilt_steps == 1, "step 2 was not rebuilt without the evicted request")
    held.release.set()
    assert held.done.wait(60)
    held.decode_loop.stop()
    assert sorted(held.retired) == ["0", "1"]
    assert all("1" not in batch for batch in held.batches)
    # Step 1 ran both rows and the evicted row's token was dropped; step 2 ran without it
    # (had it run as first built, a second token would have been computed and dropped).
    assert held.decode_loop.stats.steps == max_new[0] - 1 and held.decode_loop.stats.dropped_tokens == 1
    assert held.decoded(0) == held.ref.greedy(prompts[0], max_new[0], ignore_eos=True)
