"""A long bf16 prompt's causal attention (`prefill_attention.c`), on every torch thread.

Prompts past native_step's rows go through transformers' modules, whose attention
is SDPA: at 1,024 tokens of SmolLM-135M's shape in bf16 it took 785 of 1,968 ms on
one thread (~50 GFLOP/s, no faster than float32). transformers' "sdpa" attention
function is wrapped here (as slot_attention wraps it for decode steps): a call
this kernel serves (bf16 on a CPU with AVX512_BF16, one sequence, at least
MIN_ROWS query rows, a head size that is a multiple of 64, causal with no window
shorter than the keys, no dropout or other term) runs here, split between the
calling thread and a pool of torch.get_num_threads() - 1 more; any other call goes
to transformers' sdpa unchanged. `TorchBackend` checks at start-up that a prefill
through this kernel gives the logits and K/V of one through SDPA (within bf16's
tolerance), and only then marks its model's attention modules served (`serve`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import pathlib

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..dtype_choice import cpu_flags
from . import small_gemm

log = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).with_name("prefill_attention.c")
# -fopenmp: the threads are torch's own (OpenMP's team; see prefill_attention.c). Threads of our
# own lost to it: OpenMP's threads spin after each product, and on two cores a second thread of
# ours got no core (a layer's attention took 10.8 ms on two threads, as on one).
FLAGS = ("-O3", "-mavx2", "-mfma", "-mavx512f", "-mavx512bf16", "-mavx512vl", "-fopenmp", "-shared", "-fPIC")
LIBRARIES = ("-lmvec", "-lm")  # glibc's vector expf
NEEDS = ("avx512f", "avx512vl", "avx512_bf16")  # /proc/cpuinfo's names
# Fewer query rows keep SDPA: a decode step's row, a short suffix past a cached prefix.
MIN_ROWS = 16
# Set on an attention module whose prefills this kernel serves (`serve`).
SERVES = "disagg_prefill_kernel"
# Keyword arguments that change the attention's arithmetic (as slot_attention's); sliding_window is judged by its size.
UNSERVED = ("softcap", "sinks", "s_aux", "position_bias", "sliding_window_size", "alibi")


class _Job(ctypes.Structure):
    _fields_ = [
        ("query", ctypes.c_void_p), ("query_head_stride", ctypes.c_long), ("query_row_stride", ctypes.c_long),
        ("q_rows", ctypes.c_long), ("q_heads", ctypes.c_long),
        ("packed_keys", ctypes.c_void_p), ("packed_values", ctypes.c_void_p),
        ("kv_heads", ctypes.c_long), ("kv_len", ctypes.c_long), ("d", ctypes.c_long), ("scale", ctypes.c_float),
        ("out", ctypes.c_void_p), ("out_head_stride", ctypes.c_long), ("out_row_stride", ctypes.c_long),
    ]


class PrefillAttention:
    def __init__(self, library: ctypes.CDLL):
        long, pointer = ctypes.c_long, ctypes.c_void_p
        self._attend = library.prefill_attention
        self._attend.argtypes, self._attend.restype = [ctypes.POINTER(_Job), pointer, long, long, pointer, long, long, ctypes.c_int, pointer], None
        self._work = library.prefill_attention_work
        self._work.argtypes, self._work.restype = [long], long
        self._packed_size = library.prefill_packed_size
        self._packed_size.argtypes, self._packed_size.restype = [long, long], long
        self.calls = 0  # how many attentions it has computed (the start-up check asks whether any)

    def entry_points(self, d: int) -> tuple[int, int, int]:
        """For native_step.c, which calls the kernel itself: the addresses of prefill_attention and
        prefill_packed_size, and the floats of work one thread needs at head size d."""
        address = ctypes.cast(self._attend, ctypes.c_void_p).value, ctypes.cast(self._packed_size, ctypes.c_void_p).value
        return *address, self._work(d)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
        """query [1, q_heads, q_rows, d], key and value [1, kv_heads, kv_len, d], bf16, d contiguous
        (any other strides); query row i at position kv_len - q_rows + i,
        attending causally -> [1, q_rows, q_heads, d] bf16, as transformers' sdpa returns it."""
        _, q_heads, q_rows, d = query.shape
        _, kv_heads, kv_len, _ = key.shape
        # The C side reads raw pointers: anything off here would read past the buffers, not fail.
        if not served_shapes(query, key, value):
            raise ValueError(
                f"prefill_attention: query {tuple(query.shape)} {query.stride()} {query.dtype}, key {tuple(key.shape)} {key.stride()} {key.dtype},"
                f" value {tuple(value.shape)} {value.stride()} {value.dtype}: one sequence of bf16, d a multiple of 64 and contiguous, q_rows <= kv_len"
            )
        packed_size = self._packed_size(kv_len, d)
        packed_keys = torch.empty(kv_heads, packed_size, dtype=torch.bfloat16)
        packed_values = torch.empty(kv_heads, packed_size, dtype=torch.bfloat16)
        out = torch.empty(1, q_rows, q_heads, d, dtype=torch.bfloat16)
        threads = max(1, torch.get_num_threads())
        work = torch.empty(threads * self._work(d), dtype=torch.float32)
        job = _Job(query.data_ptr(), query.stride(1), query.stride(2), q_rows, q_heads, packed_keys.data_ptr(), packed_values.data_ptr(),
                   kv_heads, kv_len, d, scale, out.data_ptr(), out.stride(2), out.stride(1))
        self.calls += 1
        self._attend(
            ctypes.byref(job), key.data_ptr(), key.stride(1), key.stride(2), value.data_ptr(), value.stride(1), value.stride(2), threads, work.data_ptr()
        )
        return out


def served_shapes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    return (
        query.dtype == key.dtype == value.dtype == torch.bfloat16
        and query.device.type == key.device.type == value.device.type == "cpu"
        and query.dim() == key.dim() == value.dim() == 4
        and query.shape[0] == key.shape[0] == value.shape[0] == 1
        and key.shape == value.shape
        and query.shape[3] == key.shape[3]
        and query.shape[3] % 64 == 0
        and query.shape[1] % key.shape[1] == 0
        and 0 < query.shape[2] <= key.shape[2]
        and query.stride(3) == key.stride(3) == value.stride(3) == 1
    )


def kernel() -> PrefillAttention | None:
    """The kernel, or None where it cannot run here (logged once)."""
    return _kernel()


@functools.cache
def _kernel() -> PrefillAttention | None:
    unused = "long bf16 prompts' attention runs in SDPA"
    missing = [flag for flag in NEEDS if flag not in cpu_flags()]
    if missing:
        log.info("%s: the CPU has no %s", unused, ", ".join(missing))
        return None
    library = small_gemm.load_library(SOURCE, FLAGS, LIBRARIES, unused)
    return PrefillAttention(library) if library is not None else None


def _served(query, key, value, attention_mask, dropout, kwargs, causal: bool = True) -> bool:
    if query.shape[2] < MIN_ROWS or dropout or any(kwargs.get(name) is not None for name in UNSERVED) or not served_shapes(query, key, value):
        return False
    window = kwargs.get("sliding_window")
    if window is not None and window < key.shape[2]:
        return False
    q_rows, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None:  # transformers' sdpa then runs is_causal as given (top-left aligned: only a whole prompt is causal here)
        return causal and q_rows == kv_len
    return attention_mask.dtype == torch.bool and attention_mask.shape == (1, 1, q_rows, kv_len) and torch.equal(
        attention_mask[0, 0], causal_mask(q_rows, kv_len)
    )


@functools.lru_cache(maxsize=8)
def causal_mask(q_rows: int, kv_len: int) -> torch.Tensor:
    """[q_rows, kv_len] bool: row i (position kv_len - q_rows + i) attends keys up to its position.
    Kept for the next layers' calls (a prompt's every layer asks for the same); never written to."""
    return torch.ones(q_rows, kv_len, dtype=torch.bool).tril(kv_len - q_rows)


def _wrap(sdpa):
    @functools.wraps(sdpa)
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)  # as transformers' sdpa reads it
        ours = getattr(module, SERVES, False) and getattr(key, "disagg_paged", None) is None
        if ours and _served(query, key, value, attention_mask, dropout, kwargs, causal):
            scale = scaling if scaling is not None else query.shape[3] ** -0.5
            return _kernel().attend(query, key, value, scale), None
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)

    attention.disagg_prefill_attention = True
    return attention


def serve(attention_modules, on: bool = True) -> None:
    """Whether these attention modules' prefills run here (once `install`ed): a model's, once its
    start-up check agrees. Other models in the process keep SDPA."""
    for module in attention_modules:
        setattr(module, SERVES, on)


def install() -> None:
    """Idempotent: wraps transformers' "sdpa" attention function once per process."""
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    if not getattr(sdpa, "disagg_prefill_attention", False):
        ALL_ATTENTION_FUNCTIONS["sdpa"] = _wrap(sdpa)
