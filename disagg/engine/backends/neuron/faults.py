"""Which Neuron runtime errors mean the device is lost (DeviceLost) and which fail only one step.

torch-neuronx raises a Neuron runtime (NRT) failure as a RuntimeError carrying the call and
its NRT_STATUS, as `<nrt call> status=<code> message="<text>"`: for example
`RuntimeError: nrt_tensor_allocate status=4 message="Allocation Failure"` (vllm-project/vllm#12443)
and `RuntimeError: nrt_load_collectives status=4 message="Allocation Failure"`
(aws-neuron/aws-neuron-samples#96); a step's execution fails the same way from nrt_execute. The
runtime's own log lines name the status instead (`Failure: NRT_RESOURCE in nrt_load()`), and
either form is read here.

The codes and what they mean are NRT_STATUS in the runtime's header, nrt/nrt_status.h
(aws-neuron-sdk: src/libnrt/include/nrt/nrt_status.h, documented in the SDK's nrt_status.h API
page and docs/neuron-runtime/nrt-return-codes.md). A fatal status is one after which no later
step on this device can be trusted (hardware fault, lost or closed runtime, device memory
exhausted, a hang): the worker drains and exits so its supervisor starts a fresh process. Every
other RuntimeError fails only its step's requests; FailureStreak (disagg/engine/faults.py) still
ends a worker whose steps keep failing.
"""

from __future__ import annotations

import contextlib
import re

from ...faults import DeviceLost

# nrt_status.h: NRT_STATUS. Fatal: the device or the runtime cannot be trusted for the next step.
FATAL_STATUSES = {
    3: "NRT_INVALID_HANDLE",  # the loaded model's handle is gone: nothing more can run on it
    4: "NRT_RESOURCE",  # failed to allocate a resource (device memory, DMA rings): out of memory on the device
    5: "NRT_TIMEOUT",  # the request timed out: the NeuronCore hangs
    6: "NRT_HW_ERROR",  # hardware failure
    11: "NRT_FAIL_HOST_MEM_ALLOC",  # the runtime could not allocate host memory
    13: "NRT_UNINITIALIZED",  # the runtime is not (any more) initialized
    14: "NRT_CLOSED",  # the runtime was closed
    101: "NRT_EXEC_UNIT_UNRECOVERABLE",  # "Execution Unit cannot recover"
    1004: "NRT_EXEC_COMPLETED_WITH_ERR",  # logical or hardware (parity) errors: the device state may be wrong
    1200: "NRT_EXEC_HW_ERR_COLLECTIVES",  # stuck in a collective: a hang across ranks
    1201: "NRT_EXEC_HW_ERR_HBM_UE",  # unrepairable uncorrectable HBM error: the KV cache may be corrupt
    1202: "NRT_EXEC_HW_ERR_NC_UE",  # NeuronCore on-chip memory parity error
    1203: "NRT_EXEC_HW_ERR_DMA_ABORT",  # the DMA engine halted
    1204: "NRT_EXEC_SW_NQ_OVERFLOW",  # dropped notifications: the execution timed out
    1205: "NRT_EXEC_HW_ERR_REPAIRABLE_HBM_UE",  # HBM error that needs a repair (a reset) first
    1206: "NRT_NETWORK_PROXY_FAILURE",  # EFA proxy failed: collectives cannot run
}
# Per step: the input or a transient condition failed this step, the device is fine.
STEP_STATUSES = {
    1: "NRT_FAILURE",  # non-specific; a repeat ends the worker through the streak
    2: "NRT_INVALID",  # invalid input to the NEFF (tensor name or size)
    7: "NRT_QUEUE_FULL",  # transient: too many executions in flight
    1002: "NRT_EXEC_BAD_INPUT",
    1003: "NRT_EXEC_COMPLETED_WITH_NUM_ERR",  # NaN in this step's numbers
    1005: "NRT_EXEC_NC_BUSY",  # the core is locked by another model or thread, transiently
    1006: "NRT_EXEC_OOB",  # an indirect copy out of bounds, from this step's input (the runtime refused it)
}
_FATAL_NAMES = {name: code for code, name in FATAL_STATUSES.items()}
_STATUS = re.compile(r"\bstatus\s*[=:]\s*(\d+)")
_NAME = re.compile(r"\bNRT_[A-Z0-9_]+\b")


def nrt_status(message: str) -> tuple[int, str] | None:
    """(code, name) of the NRT status a runtime error message carries; None when it carries none."""
    found = _STATUS.search(message)
    if found:
        code = int(found.group(1))
        return code, FATAL_STATUSES.get(code) or STEP_STATUSES.get(code) or f"NRT status {code}"
    for name in _NAME.findall(message):
        if name in _FATAL_NAMES:
            return _FATAL_NAMES[name], name
        if name in STEP_STATUSES.values():
            return next(code for code, known in STEP_STATUSES.items() if known == name), name
    return None


def classify(exc: BaseException) -> BaseException:
    """DeviceLost (caused by exc) when exc is a runtime error with a fatal NRT status; otherwise exc itself."""
    if not isinstance(exc, RuntimeError) or isinstance(exc, DeviceLost):
        return exc
    status = nrt_status(str(exc))
    if status is None or status[0] not in FATAL_STATUSES:
        return exc
    lost = DeviceLost(f"Neuron runtime {status[1]} ({status[0]}): {exc}")
    lost.__cause__ = exc
    return lost


@contextlib.contextmanager
def device_errors():
    """Around device work (also a decorator): a fatal Neuron runtime error comes out as DeviceLost."""
    try:
        yield
    except RuntimeError as exc:
        classified = classify(exc)
        if classified is exc:
            raise
        raise classified from exc
