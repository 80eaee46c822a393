"""Chunk coalescing, driven step by step (no timing): the router's merge for slow
clients, the decode worker's merge of queued steps, and stop sequences that end
inside a merged run of tokens."""

import asyncio

import grpc
import pytest
from conftest import reference

from decode_worker.decode_loop import TokenEvent
from decode_worker.worker import _first_merged
from disagg.engine.requests import FinishReason, Sampling, Stopping, TokenLogprobs
from disagg.rpc.server import RequestError
from router.coalesce import coalesced, merge, merge_per_choice
from router.lifecycle import Chunk, TextAssembler
from router.validation import GenerationRequest


class Feed:
    """A chunk source the test advances by hand."""

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.closed = False

    async def chunks(self):
        try:
            while (item := await self.queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            self.closed = True


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


def test_chunks_that_wait_for_a_slow_reader_go_out_as_one():
    async def run():
        feed = Feed()
        stream = coalesced(feed.chunks())
        feed.queue.put_nowait(Chunk([1], "a"))
        assert await anext(stream) == Chunk([1], "a")  # a reader that keeps up: one by one
        for chunk in (Chunk([2], "b"), Chunk([3], ""), Chunk([4], "cd")):
            feed.queue.put_nowait(chunk)
        await settle()  # the reader is busy meanwhile
        assert await anext(stream) == Chunk([2, 3, 4], "bcd")
        feed.queue.put_nowait(Chunk([5], "e", FinishReason.LENGTH, prompt_tokens=3, completion_tokens=5))
        feed.queue.put_nowait(None)
        await settle()
        assert await anext(stream) == Chunk([5], "e", FinishReason.LENGTH, prompt_tokens=3, completion_tokens=5)
        with pytest.raises(StopAsyncIteration):
            await anext(stream)

    asyncio.run(run())


def test_the_finish_and_usage_of_the_last_merged_chunk_stand():
    merged = merge([Chunk([7], "x"), Chunk([8, 9], "yz", FinishReason.STOP, prompt_tokens=4, completion_tokens=3, total_seconds=1.5)])
    assert merged == Chunk([7, 8, 9], "xyz", FinishReason.STOP, prompt_tokens=4, completion_tokens=3, total_seconds=1.5)


def test_an_error_comes_after_the_chunks_before_it():
    async def run():
        feed = Feed()
        stream = coalesced(feed.chunks())
        feed.queue.put_nowait(Chunk([1], "a"))
        feed.queue.put_nowait(Chunk([2], "b"))
        feed.queue.put_nowait(RequestError("worker gone", grpc.StatusCode.UNAVAILABLE))
        await settle()
        assert await anext(stream) == Chunk([1, 2], "ab")
        with pytest.raises(RequestError) as error:
            await anext(stream)
        assert error.value.code == grpc.StatusCode.UNAVAILABLE

    asyncio.run(run())


def test_a_client_that_goes_away_closes_the_source():
    async def run():
        feed = Feed()
        stream = coalesced(feed.chunks())
        feed.queue.put_nowait(Chunk([1], "a"))
        await anext(stream)
        await stream.aclose()
        await settle()
        assert feed.closed  # the request's workers are released by the source's own cleanup

    asyncio.run(run())


def test_decode_steps_queued_behind_a_slow_writer_merge_until_an_error_or_the_finish():
    a, b, c = TokenEvent("r", [1], FinishReason.NONE), TokenEvent("r", [2], FinishReason.NONE), TokenEvent("r", [3], FinishReason.LENGTH)
    error = RequestError("lease ran out")
    assert _first_merged([a, b, c]) == (TokenEvent("r", [1, 2, 3], FinishReason.LENGTH), [])
    assert _first_merged([a, b, error, c]) == (TokenEvent("r", [1, 2], FinishReason.NONE), [error, c])
    assert _first_merged([error, a]) == (error, [a])


def test_a_stop_sequence_inside_a_merged_run_cuts_the_tokens_after_it():
    ref = reference("llama")
    prompt = ref.ids("The library")
    tokens = ref.greedy(prompt, 24, ignore_eos=True)
    full = ref.tokenizer.decode(tokens, skip_special_tokens=True)
    stop = full.split()[3]
    request = GenerationRequest("r", prompt, Sampling(), Stopping(max_new_tokens=24), (stop,))

    one_by_one = TextAssembler(ref.tokenizer, request)
    for i, token in enumerate(tokens):
        expected = one_by_one.add([token], FinishReason.NONE)
        if expected.finish is FinishReason.STOP_SEQUENCE:
            cut = i + 1
            break
    logprobs = [TokenLogprobs(t, -0.5 * i) for i, t in enumerate(tokens)]
    merged = TextAssembler(ref.tokenizer, request).add(tokens, FinishReason.NONE, logprobs)
    assert merged.finish is FinishReason.STOP_SEQUENCE and merged.matched_stop == stop
    assert merged.token_ids == tokens[:cut] and cut < len(tokens)
    assert merged.text == full[: full.index(stop)]
    assert merged.logprobs == logprobs[:cut]  # the cut tokens' logprobs go with them


def test_a_slow_clients_chunks_merge_per_choice_keeping_each_choices_order():
    chunks = [Chunk([1], "a", index=0), Chunk([7], "x", index=1), Chunk([2], "b", index=0), Chunk([8], "y", FinishReason.LENGTH, index=1, completion_tokens=2)]
    merged = merge_per_choice(chunks)
    assert [(c.index, c.token_ids, c.text, c.finish) for c in merged] == [(0, [1, 2], "ab", FinishReason.NONE), (1, [7, 8], "xy", FinishReason.LENGTH)]
    assert merged[1].completion_tokens == 2
