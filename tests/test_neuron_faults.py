"""Neuron runtime errors: the fatal ones become DeviceLost (the worker drains and exits for its
supervisor), the rest fail only their step. Pure Python: no Neuron device, no NxDI, except the
last test, which loads the backend on tests/nxdi_standin."""

from __future__ import annotations

import pytest
import torch

from disagg.engine.backends.neuron.faults import FATAL_STATUSES, STEP_STATUSES, classify, device_errors, nrt_status
from disagg.engine.faults import DeviceLost

# The shapes torch-neuronx and the runtime's log give (see disagg/engine/backends/neuron/faults.py).
FATAL = [
    'nrt_execute status=1203 message="DMA engine encountered an unrecoverable error"',
    'nrt_tensor_allocate status=4 message="Allocation Failure"',
    'nrt_execute status=5 message="Timeout"',
    'nrt_execute status=1201 message="HBM UE"',
    "Failure: NRT_EXEC_HW_ERR_NC_UE in nrt_execute()",
    "Failure: NRT_RESOURCE in nrt_load()",
    'nrt_execute status=1004 message="Execution was completed with other errors"',
]
PER_STEP = [
    'nrt_execute status=1006 message="out of bound"',
    'nrt_execute status=1002 message="bad input"',
    'nrt_execute status=1003 message="NaN"',
    'nrt_execute status=1005 message="NC busy"',
    "selected index k out of range",  # no NRT status at all: a bounds check, a shape error
    "Incompatible runtime state: NRT_STATE_CHILD",  # names no status this module knows
]


@pytest.mark.parametrize("message", FATAL)
def test_a_fatal_runtime_status_is_device_lost_naming_the_status(message):
    lost = classify(RuntimeError(message))
    assert isinstance(lost, DeviceLost) and message in str(lost) and "NRT_" in str(lost)
    assert isinstance(lost.__cause__, RuntimeError) and str(lost.__cause__) == message


@pytest.mark.parametrize("message", PER_STEP)
def test_other_runtime_errors_fail_only_their_step(message):
    error = RuntimeError(message)
    assert classify(error) is error


def test_statuses_are_read_by_number_or_name_and_listed_once():
    assert nrt_status('nrt_execute status=1203 message="x"') == (1203, "NRT_EXEC_HW_ERR_DMA_ABORT")
    assert nrt_status("Failure: NRT_TIMEOUT in nrt_execute()") == (5, "NRT_TIMEOUT")
    assert nrt_status("status=77") == (77, "NRT status 77")  # unknown: per step (the streak still counts it)
    assert classify(RuntimeError("status=77")).__class__ is RuntimeError
    assert not set(FATAL_STATUSES) & set(STEP_STATUSES)
    assert classify(ValueError("status=6")).__class__ is ValueError  # only the runtime's RuntimeError
    lost = DeviceLost("already")
    assert classify(lost) is lost


def test_device_errors_raises_device_lost_only_for_fatal_statuses():
    @device_errors()
    def step(message: str):
        raise RuntimeError(message)

    with pytest.raises(DeviceLost, match="NRT_HW_ERROR"):
        step('nrt_execute status=6 message="Hardware failure"')
    with pytest.raises(RuntimeError) as raised:
        step('nrt_execute status=1006 message="oob"')
    assert type(raised.value) is RuntimeError


class _FailingModel:
    """NxDI's model as far as the backend's step calls it: forward raises what the runtime would."""

    def __init__(self, message: str):
        self.message = message

    def forward(self, **inputs):
        raise RuntimeError(self.message)


def _backend_with(message: str):
    """A NeuronBackend whose model raises `message`: only what decode_step touches is set up."""
    from disagg.engine.backends.neuron.backend import NeuronBackend
    from disagg.engine.backends.neuron.config import NeuronOptions

    backend = NeuronBackend.__new__(NeuronBackend)
    backend.options = NeuronOptions(model="/m")
    backend.model = _FailingModel(message)
    return backend


def _inputs():
    from disagg.engine.backends import StepInputs
    from disagg.engine.requests import Sampling
    from disagg.engine.sampler import params_tensor

    return StepInputs(
        slots=torch.tensor([0, 1]), positions=torch.tensor([6, 4]), input_ids=torch.tensor([5, 7]),
        params=params_tensor([Sampling(), Sampling()]), seeds=torch.tensor([0, 0]), steps=torch.tensor([1, 1]),
        kv_len=7, min_position=4, contiguous_from=0, penalized=False, top_logprobs=0,
    )


def test_the_backends_decode_step_raises_device_lost_for_a_hardware_error_and_the_error_itself_otherwise():
    with pytest.raises(DeviceLost, match="NRT_EXEC_HW_ERR_DMA_ABORT"):
        _backend_with('nrt_execute status=1203 message="DMA abort"').decode_step(_inputs())
    with pytest.raises(RuntimeError) as raised:
        _backend_with('nrt_execute status=1006 message="oob"').decode_step(_inputs())
    assert type(raised.value) is RuntimeError  # per step: the decode loop fails its rows and goes on


def test_the_backend_on_the_standin_maps_its_models_runtime_error(monkeypatch, tmp_path):
    from test_neuron_backend import NEEDS_NXDI_TRANSFORMERS, NXDI_TRANSFORMERS, STANDIN

    if not NXDI_TRANSFORMERS:
        pytest.skip(NEEDS_NXDI_TRANSFORMERS)
    import sys

    from conftest import reference, tiny_model

    from disagg.engine.backends import load_backend
    from disagg.engine.requests import Sampling

    monkeypatch.syspath_prepend(STANDIN)
    for name in [n for n in sys.modules if n.startswith("neuronx_distributed_inference")]:
        monkeypatch.delitem(sys.modules, name)
    try:
        backend = load_backend("neuron", model=tiny_model("llama"), dtype="float32", max_seq_len=64, batch_size=2,
                               neuron={"tp_degree": 1, "compiled_root": str(tmp_path)})
        ids = reference("llama").ids("The baker opens his shop")
        assert backend.prefill(ids, Sampling()).first_token >= 0  # the stand-in's own forward works

        def lost_core(**inputs):
            raise RuntimeError('nrt_execute status=1202 message="NeuronCore parity error"')

        monkeypatch.setattr(backend.model, "forward", lost_core)
        with pytest.raises(DeviceLost, match="NRT_EXEC_HW_ERR_NC_UE"):
            backend.prefill(ids, Sampling())
    finally:
        for name in [n for n in sys.modules if n.startswith("neuronx_distributed_inference")]:
            del sys.modules[name]


def test_the_backend_classifies_errors_wherever_they_surface():
    """NeuronBackend.device_error: what the decode loop asks at the host/device sync (async mode)."""
    from disagg.engine.backends.neuron.backend import NeuronBackend

    fatal = RuntimeError('nrt_execute status=1201 message="Unrepairable HBM error"')
    lost = NeuronBackend.device_error(None, fatal)
    assert isinstance(lost, DeviceLost) and "NRT_EXEC_HW_ERR_HBM_UE" in str(lost) and lost.__cause__ is fatal
    step_only = RuntimeError('nrt_execute status=1003 message="NaN"')
    assert NeuronBackend.device_error(None, step_only) is step_only
