"""Test hooks for the worker processes of tests/test_neuron_serve.py (on PYTHONPATH there only).

When a process imports the NxDI stand-in's model module, this records the
process's NEURON_RT_VISIBLE_CORES (DISAGG_TEST_RECORD_DIR) and, with
DISAGG_TEST_COMPILE_GATE set, makes the stand-in's compile() wait after it has
written everything (config, model.pt, weights) until that file exists: a compile
as long as the test wants, and a process the test can kill once model.pt is
there but before compile() returned (issue 28's finding 4).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import time

TARGET = "neuronx_distributed_inference.models.standin_model"


def record_environment() -> None:
    where = os.environ.get("DISAGG_TEST_RECORD_DIR")
    if where:
        with open(os.path.join(where, f"{os.getpid()}.json"), "w") as f:
            json.dump({"argv": sys.argv, "NEURON_RT_VISIBLE_CORES": os.environ.get("NEURON_RT_VISIBLE_CORES")}, f)


def gate_compile(module) -> None:
    cls = module.StandInCausalLM
    original = cls.compile

    def compile_then_wait(self, compiled_model_path, *args, **kwargs):
        original(self, compiled_model_path, *args, **kwargs)
        gate = os.environ.get("DISAGG_TEST_COMPILE_GATE")
        while gate and not os.path.exists(gate):
            time.sleep(0.05)  # the test opens the gate

    cls.compile = compile_then_wait


class PatchStandIn(importlib.abc.MetaPathFinder):
    """Finds the stand-in's model module as usual, and runs the hooks once it is executed."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            record_environment()
            gate_compile(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, PatchStandIn())
