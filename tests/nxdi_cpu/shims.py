"""Import shims for the hardware-only packages NxDI and NxD import at module level.

NxDI (neuronx-distributed-inference) and NxD (neuronx-distributed) import
torch_neuronx, neuronxcc, libneuronxla, nki, nkilib and torch_xla at module
level, even on the paths their CPU mode (NeuronConfig(on_cpu=True), to_cpu())
never calls. These shims let those imports succeed on a machine without the
Neuron SDK: every name under the six roots is a stub module, registered in
sys.modules so that `import a.b.c` and `from a.b import c` both work, and
calling one raises "hardware path reached: <name>". A CPU run that reaches
hardware code therefore fails loudly instead of doing something plausible.

The few names a CPU run does use get real behaviour (REAL below), each for the
NxDI/NxD code that needs it at import or while setting up parallel state.
Nothing here is NxDI's or NxD's code.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.machinery
import sys
import types

import torch

HARDWARE_ROOTS = ("torch_neuronx", "neuronxcc", "libneuronxla", "nki", "nkilib", "torch_xla")


class HardwarePathReached(RuntimeError):
    pass


class StubModule(types.ModuleType):
    """A module whose every unknown attribute is a stub submodule, and whose call raises."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        child = stub_module(f"{self.__name__}.{name}")
        setattr(self, name, child)
        return child

    def __call__(self, *args, **kwargs):
        raise HardwarePathReached(f"hardware path reached: {self.__name__}")

    def __mro_entries__(self, bases):
        # `class K(stub.SomeBase)` at import: a plain base whose instances raise when made.
        return (stub_base(self.__name__),)

    def __iter__(self):
        raise HardwarePathReached(f"hardware path reached: iterating {self.__name__}")


def stub_base(name: str) -> type:
    def refuse(self, *args, **kwargs):
        raise HardwarePathReached(f"hardware path reached: {name}()")

    return type(name.rsplit(".", 1)[-1], (), {"__init__": refuse})


def stub_module(name: str) -> StubModule:
    if name in sys.modules:
        return sys.modules[name]
    module = StubModule(name)
    module.__path__ = []  # a package: submodules import through the finder below
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__file__ = f"<import shim {name}>"
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(stub_module(parent), child, module)
    return module


class _ShimFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".", 1)[0] in HARDWARE_ROOTS:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return stub_module(spec.name)

    def exec_module(self, module):
        pass


# -- the names a CPU run uses, with real behaviour -----------------------------------------


def identity_decorator(*args, **kwargs):
    """nki.jit, nki_jit, xla_hlo_call: used bare (@nki.jit) or called (@nki.jit(...)).

    CPU mode never calls the decorated kernels (NxDI branches on cpu_mode() first)."""
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda function: function


class CollectivesConfig:
    """neuronxcc.nki._pre_prod_kernels.collectives.CollectivesConfig: NxD's
    initialize_model_parallel builds it from the context-parallel replica groups and reads
    rank_src_tgt_pairs[rank]: each rank's (source, target) neighbours on its ring."""

    def __init__(self, replica_groups=(), **kwargs):
        pairs = {}
        for group in replica_groups:
            for i, rank in enumerate(group):
                pairs[rank] = [group[i - 1], group[(i + 1) % len(group)]]
        self.rank_src_tgt_pairs = [pairs.get(rank, [rank, rank]) for rank in range(max(pairs, default=-1) + 1)]


@dataclasses.dataclass(frozen=True)
class SkipMode:
    """nkilib's moe_cte_utils.SkipMode: built at import as a dataclass default (SkipMode(False, False))."""

    skip_token: bool = False
    skip_weight: bool = False


def _platform_target() -> str:
    # torch_neuronx.utils.get_platform_target(): read while setting up parallel state.
    return "trn1"


REAL = {
    "torch_neuronx.utils": {"get_platform_target": _platform_target},
    "torch_neuronx.xla_impl.ops": {"nki_jit": identity_decorator, "xla_hlo_call": identity_decorator},
    "torch_neuronx.xla_impl.base": {"xla_hlo_call": identity_decorator},
    "nki": {"jit": identity_decorator},
    "neuronxcc.nki._pre_prod_kernels.collectives": {"CollectivesConfig": CollectivesConfig},
    # NxD's modules/moe/blockwise.py imports it through nki_import (nkilib first) for a dataclass default.
    "nkilib.core.moe.moe_cte.moe_cte_utils": {"SkipMode": SkipMode},
}


class _NeuronClassNamespace:
    """torch.classes.neuron: neuronx_distributed/trace/spmd.py reads torch.classes.neuron.SPMDModel
    at import (an annotation); the real class exists only in torch-neuronx's runtime."""

    def __getattr__(self, name):
        return stub_module(f"torch.classes.neuron.{name}")


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _scatter_moving_fp8_as_bytes(scatter):
    """torch.scatter for an fp8 tensor on the CPU, where PyTorch has no such kernel ("scatter_gather_tensor_cpu"
    not implemented for 'Float8_e4m3fn'): the same elements moved, as their bytes. NxDI's fp8 KV cache scatters its
    token-generation lines into the cache (KVCacheManager.update_kv_by_layer_id), which the device does in XLA."""

    def wrapped(input, dim, index, src=None, *args, **kwargs):
        if isinstance(src, torch.Tensor) and input.dtype in _FP8 and src.dtype == input.dtype and input.device.type == "cpu" and not args and not kwargs:
            return scatter(input.view(torch.uint8), dim, index, src.view(torch.uint8)).view(input.dtype)
        return scatter(input, dim, index, src, *args, **kwargs) if src is not None else scatter(input, dim, index, *args, **kwargs)

    return wrapped


def install() -> None:
    """Registers the shims once per process; call before importing NxDI or NxD."""
    if any(isinstance(finder, _ShimFinder) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, _ShimFinder())
    torch.scatter = _scatter_moving_fp8_as_bytes(torch.scatter)
    for module_name, names in REAL.items():
        module = stub_module(module_name)
        for name, value in names.items():
            setattr(module, name, value)
    torch.classes.neuron = _NeuronClassNamespace()

