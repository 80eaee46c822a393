"""Colocated mode (`--colocated`): this decode worker also serves PrefillService.

Prompts run on the same device thread as the decode steps, between them, and
their KV goes straight into the reserved slot: one process doing both phases,
as a non-disaggregated server does. It is the baseline the benchmarks compare
disaggregation against, built from the same code.

A prefill that raises costs what it does on a prefill worker (disagg/engine/faults.py):
its request ends with INTERNAL naming the cause and its reservation is freed, while the
decode loop and the other requests go on. Prefills that keep failing, or one that raises
DeviceLost, mean the shared device cannot be trusted: the decode loop fails every row and
the worker drains and exits non-zero, as on a failing decode step.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

import grpc

from disagg.engine.faults import TEST_FAIL_PREFILL_STEP, FailureStreak, describe, with_injected_faults
from disagg.rpc import worker_messages
from disagg.rpc.server import RequestError, check_parsed
from disagg.v1 import worker_pb2 as wpb

from .worker import DecodeWorker

log = logging.getLogger(__name__)


class ColocatedPrefillServicer:
    def __init__(self, decode_servicer):
        self._decode = decode_servicer  # shares its worker once the model is loaded
        self.pending = 0
        self._streak = FailureStreak()  # prefills failing in a row; the decode steps keep their own in the decode loop
        # Read once, at start-up; unset, the step is the backend's own prefill.
        self._prefill_step = with_injected_faults(self._backend_prefill, TEST_FAIL_PREFILL_STEP)

    def _backend_prefill(self, *args, **kwargs):
        return self._decode.worker.backend.prefill(*args, **kwargs)

    async def Prefill(self, request: wpb.PrefillRequest, context: grpc.aio.ServicerContext):
        worker: DecodeWorker = await self._decode._ready(context)
        try:
            order = worker_messages.prefill_order_from_pb(check_parsed(request), worker.info)
            ids, sampling = order.token_ids, order.sampling
            key = order.target[1] if order.target else None
            if worker.failure is not None:
                raise RequestError(f"decode worker is stopping: {worker.failure}", grpc.StatusCode.UNAVAILABLE)
            self.pending += 1
            started = time.perf_counter()
            try:
                worker_messages.check_sampling(worker.backend, sampling)
                step = self._prefill_step
                if sampling.constraint is not None:
                    with worker_messages.worker_names():
                        bitmask = await worker.constraints.first_bitmask(sampling.constraint, ids[len(ids) - order.first_step :])
                    step = functools.partial(step, bitmask=bitmask)
                on_device = worker.decode_loop.run_on_device(step, ids, sampling, None, order.first_step)
                result = await self._contained(worker, key, f"prefill of {len(ids)} tokens", asyncio.wrap_future(on_device))
            finally:
                self.pending -= 1
            logprobs = worker_messages.logprobs_to_pb(result.logprobs) if result.logprobs else None
            yield wpb.PrefillEvent(first_token=wpb.FirstToken(token_id=result.first_token, prefill_seconds=time.perf_counter() - started, logprobs=logprobs))
            if key is not None:
                copied = await self._contained(worker, key, "KV copy", worker.colocated_fill(key, ids, result.first_token, result.layers))
                yield wpb.PrefillEvent(kv_sent=wpb.KvSent(bytes=copied, seconds=0.0))
        except RequestError as exc:
            await context.abort(exc.code, str(exc))

    async def _contained(self, worker: DecodeWorker, key: str | None, what: str, device_work):
        """device_work's result (its device part runs between decode steps). One that raises fails only
        this request: INTERNAL naming the cause, its reservation freed; failures in a row, or
        DeviceLost, stop the worker."""
        try:
            result = await device_work
        except RequestError:
            raise
        except Exception as raised:
            exc = worker.backend.device_error(raised)
            log.error("colocated %s failed: %s", what, describe(exc), exc_info=raised)
            error = RequestError(f"prefill failed: {describe(exc)}", grpc.StatusCode.INTERNAL)
            if key is not None:
                worker._fail(key, error)  # the Decode call holding the reservation ends with the cause; its slot is freed
            if worker.failure is None and self._streak.failed(exc):
                worker.decode_loop.device_failed(self._streak.cause(exc, "prefills"))
            raise error from exc
        self._streak.succeeded()
        return result

    async def GetLoad(self, request, context) -> wpb.WorkerLoad:
        worker = await self._decode._ready(context)
        return worker_messages.worker_load("prefill", worker.info, worker.config, capacity=1, queued=self.pending)
