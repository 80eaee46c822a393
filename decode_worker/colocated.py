"""Colocated mode (`--colocated`): this decode worker also serves PrefillService.

Prompts run on the same device thread as the decode steps, between them, and
their KV goes straight into the reserved slot: one process doing both phases,
as a non-disaggregated server does. It is the baseline the benchmarks compare
disaggregation against, built from the same code.
"""

from __future__ import annotations

import time

import grpc

from disagg import wire
from disagg.rpc import RequestError, check_parsed
from disagg.v1 import worker_pb2 as wpb

from .worker import DecodeWorker


class ColocatedPrefillServicer:
    def __init__(self, decode_servicer):
        self._decode = decode_servicer  # shares its worker once the model is loaded
        self.pending = 0

    async def Prefill(self, request: wpb.PrefillRequest, context: grpc.aio.ServicerContext):
        worker: DecodeWorker = await self._decode._ready(context)
        try:
            order = wire.prefill_order_from_pb(check_parsed(request), worker.info)
            ids, sampling = order.token_ids, order.sampling
            key = order.target[1] if order.target else None
            self.pending += 1
            started = time.perf_counter()
            try:
                wire.check_sampling(worker.backend, sampling)
                result = await worker.colocated_prefill(ids, sampling, order.first_step)
            finally:
                self.pending -= 1
            logprobs = wire.logprobs_to_pb(result.logprobs) if result.logprobs else None
            yield wpb.PrefillEvent(first_token=wpb.FirstToken(token_id=result.first_token, prefill_seconds=time.perf_counter() - started, logprobs=logprobs))
            if key is not None:
                copied = await worker.colocated_fill(key, ids, result.first_token, result.layers)
                yield wpb.PrefillEvent(kv_sent=wpb.KvSent(bytes=copied, seconds=0.0))
        except RequestError as exc:
            await context.abort(exc.code, str(exc))

    async def GetLoad(self, request, context) -> wpb.WorkerLoad:
        worker = await self._decode._ready(context)
        return wire.worker_load("prefill", worker.info, capacity=1, queued=self.pending)
