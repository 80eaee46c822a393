"""`--dtype auto` (the default): the dtype that serves fastest on the device at hand.

- CPU: bfloat16 where the CPU computes bf16 natively (AVX512_BF16 or AMX-BF16:
  the Xeons since Cooper Lake, AMD's Zen 4 and later), float32 elsewhere. A
  bf16 weight is half the bytes a decode step streams, and the native step
  widens it as it reads; without native bf16, PyTorch's bf16 products (a
  prefill's) emulate it, 4-5x slower than float32's on an AVX2-only EPYC.
  A float32 model of a bf16 checkpoint still reads bf16's bytes: its weights
  are held in bf16 and widened as they are multiplied (weight_storage.py).
- CUDA: the checkpoint's own dtype (its config's), bfloat16 if it names none.
- Neuron: bfloat16, NxD Inference's default.

Each worker resolves it for itself at start-up and logs what it chose and
why. Workers on one host choose alike; a pool spread over hosts of different
classes should name its dtype, since a decode worker refuses KV of any dtype
but its cache's (the transfer fails with the field named, never a wrong
token) and the router warns when its workers report different dtypes.
"""

from __future__ import annotations

import pathlib
import platform

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo's names


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (empty where it does not)."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def choose_dtype(backend: str, device: str = "cpu", model: str | None = None, flags: set[str] | None = None) -> tuple[str, str]:
    """(dtype, why) for --dtype auto."""
    if backend == "neuron":
        return "bfloat16", "Neuron computes in bf16 (NxD Inference's default)"
    if device.startswith("cuda"):
        own = checkpoint_dtype(model)
        return (own, "the checkpoint's own dtype, on CUDA") if own else ("bfloat16", "the checkpoint names no dtype; bf16 on CUDA")
    flags = cpu_flags() if flags is None else flags
    native = [name for name in NATIVE_BF16_FLAGS if name in flags]
    if native:
        return "bfloat16", f"the CPU computes bf16 natively ({', '.join(name.upper() for name in native)})"
    where = "an x86 CPU without AVX512_BF16 or AMX" if platform.machine() in ("x86_64", "AMD64") else f"a {platform.machine()} CPU"
    return "float32", f"{where}: bf16 would be emulated, slower than float32"


def checkpoint_dtype(model: str | None) -> str | None:
    """The dtype a checkpoint's config names (bfloat16, float16 or float32), or None."""
    if not model:
        return None
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model)
    except (OSError, ValueError):
        return None
    named = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(named).removeprefix("torch.") if named is not None else None
    return name if name in ("bfloat16", "float16", "float32") else None
