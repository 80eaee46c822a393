"""A prefill worker (the real `PrefillWorker`, NIXL pull) in a process of its own,
for tests/test_kv_nixl.py: NIXL's agent stays out of pytest's process, where its
libraries have crashed a later test's native import.

    python tests/queued_prefill_probe.py '{"model": ..., "decode": ADDRESS, "prompt_ids": [...], "max_new_tokens": N}'

Reserves a slot on the decode worker, prefills the prompt, then holds the
model thread with a job that blocks (as a prefill queued after the prompt
would) and waits for the KV hand-off. Prints one JSON line: the KV bytes the
decode worker acknowledged, the tokens it decoded, and whether the model
thread was still held when they came.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading

import grpc
from prometheus_client import CollectorRegistry

from disagg.engine.backends import load_backend
from disagg.engine.requests import Sampling
from disagg.rpc.metrics import PrefillMetrics
from disagg.v1 import worker_pb2 as wpb
from disagg.v1 import worker_pb2_grpc as wgrpc
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.worker import FirstToken, KvSent, KvTarget, PrefillWorker


async def probe(args: dict) -> dict:
    ids, decode = args["prompt_ids"], args["decode"]
    config = PrefillWorkerConfig(model=args["model"], dtype="float32", kv_transport="nixl", decode_peers=(decode,))
    backend = load_backend("torch", model=config.model, dtype="float32", device="cpu", max_seq_len=256, global_topk=0, batch_size=1)
    worker = PrefillWorker(backend, config, PrefillMetrics(CollectorRegistry()))
    later_prefill = threading.Event()  # set: the prefill queued after the prompt ends
    try:
        async with grpc.aio.insecure_channel(decode) as channel:
            stopping = wpb.WorkerStopping(max_new_tokens=args["max_new_tokens"])
            request = wpb.DecodeRequest(request_id="behind-a-queue", prompt_len=len(ids), sampling=wpb.WorkerSampling(top_p=1.0), stopping=stopping)
            call = wgrpc.DecodeServiceStub(channel).Decode(request)
            reservation = (await call.read()).reserved.reservation_id
            events = worker.prefill(ids, Sampling(), KvTarget(decode, reservation))
            first = await anext(events)
            assert isinstance(first, FirstToken)
            worker._device.submit(later_prefill.wait)  # the next prompt's prefill holds the model thread
            sent = await asyncio.wait_for(anext(events), 60)  # before the fix: never, until that prefill ends
            assert isinstance(sent, KvSent)
            tokens = [first.token_id]
            while (event := await call.read()) is not grpc.aio.EOF:
                tokens += event.tokens.token_ids
            return {"kv_bytes": sent.bytes, "tokens": tokens, "model_thread_held": not later_prefill.is_set()}
    finally:
        later_prefill.set()
        await worker.stop()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(probe(json.loads(sys.argv[1])))), flush=True)
