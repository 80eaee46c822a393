"""The few-row product of `small_gemm.c`, built on first use: float32 rows times
float32 weights, in one of two builds chosen per host at first use
(`kernel(torch.float32)`):

- `float32` (any AVX2 CPU): 256-bit FMAs, blocks of 4 rows.
- `float32-avx512` (AVX-512F/VL CPUs): 512-bit FMAs, blocks of 8 rows in
  AVX-512's 32 registers, two panels at a time from 16 rows; the same panels
  and the same bits, 1.6-1.8x the AVX2 build's speed at 32 and 64 rows on a Zen 5 EPYC
  (docs/benchmarks.md, "Float32 on AVX-512").

or times bfloat16 weights (half the bytes a decode step streams), in one of
three builds chosen likewise (`kernel(torch.bfloat16)`):

- `bf16-widen` (any AVX2 CPU): each weight widened to float32 as it is read,
  float32 FMAs; the product is float32's over the bf16 weights.
- `bf16-widen-avx512` (AVX-512F/VL CPUs): the same panels widened 16 at a time
  into `float32-avx512`'s blocks; the same bits as both, and as the float32
  builds over the widened weights, so a float32 model of bf16 numbers is
  served from bf16 panels by either widen build (weight_storage.py). On an
  Ice Lake Xeon (no AVX512_BF16): 1.4-1.6x `bf16-widen`'s speed at 1-64 rows.
- `bf16-dot` (AVX512_BF16 CPUs): the rows rounded to bf16 and VDPBF16PS over
  pairs of k, twice the products per instruction; the product is a bf16
  model's own (bf16 inputs, float32 sums).

and 8-bit weights (`quantized_kernel`): int8 through `int8-vnni` (AVX512_VNNI:
VPDPBUSD over each row as an exact integer in three byte planes; `int8-vnni-bf16`
for a bf16 model's rows), `int8-dot` (a bf16 model's, AVX512_BF16) or the
float32-widening `int8` / `int8-avx512`; fp8 through `fp8-dot` or `fp8` /
`fp8-avx512`.

Where more than one of a dtype's builds run, a short measured product at first use
picks the fastest (logged with every time); `DISAGG_F32_KERNEL=avx2|avx512`,
`DISAGG_BF16_KERNEL=widen|widen-avx512|dot` and `DISAGG_INT8_KERNEL=vnni|dot|widen` name one instead.

The C file is compiled once with the system's C compiler (`$CC`, else `cc` or
`gcc`) into `$DISAGG_CACHE/small_gemm/` (default `~/.cache/disagg`), named by
a hash of the source and the flags, and loaded with ctypes. A CPU without AVX2
and FMA, or a machine with no C compiler, gets None from `kernel()` (with one
log line saying why) and `packed_linear` keeps oneDNN for every row count.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading
import time

import torch

from disagg.engine.cache_dir import cache_dir
from disagg.engine.dtype_choice import cpu_flags

log = logging.getLogger(__name__)


class BadKernelSetting(ValueError):
    """An environment variable that names a kernel or its settings (DISAGG_F32_KERNEL, DISAGG_PAIR_FROM, ...) holds a
    value no build takes: a worker refuses it at start-up in one line, as it does a flag."""

SOURCE = pathlib.Path(__file__).with_name("small_gemm.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-pthread", "-shared", "-fPIC")
VNNI_FLAGS = ("-DWEIGHT_VNNI", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512vnni")
VNNI_NEEDS = ("avx512f", "avx512vl", "avx512bw", "avx512_vnni")
AVXVNNI_FLAGS = ("-DWEIGHT_VNNI", "-DACT_INT8", "-DVNNI_AVX2", "-DAVX_VNNI", "-mavxvnni")
# Each build: its weights' dtype, its flags, the CPU features (/proc/cpuinfo's names) it needs
# beyond AVX2 and FMA. Each is a library of its own, helper thread included.
BUILDS = {
    "float32": (torch.float32, (), ()),
    # The same float32 panels read two at a time in 16-float vectors (small_gemm.c, WIDE_F32): AVX-512VL's 32 registers.
    "float32-avx512": (torch.float32, ("-DWIDE_F32", "-mavx512f", "-mavx512vl"), ("avx512f", "avx512vl")),
    "bf16-widen": (torch.bfloat16, ("-DWEIGHT_BF16",), ()),
    # The same bf16 panels widened 16 at a time into 512-bit float32 vectors (WIDE_F32's blocks): for CPUs with
    # AVX-512 but not AVX512_BF16 (Cascade Lake, Ice Lake), where bf16 weights have no native product.
    "bf16-widen-avx512": (torch.bfloat16, ("-DWEIGHT_BF16", "-DWIDE_F32", "-mavx512f", "-mavx512vl"), ("avx512f", "avx512vl")),
    "bf16-dot": (torch.bfloat16, ("-DWEIGHT_BF16", "-DDOT_BF16", "-mavx512f", "-mavx512bf16", "-mavx512vl"), ("avx512f", "avx512vl", "avx512_bf16")),
    # 8-bit weights (disagg/engine/quantization), widened to float32 as they are read; each panel carries its scales.
    "int8": (torch.int8, ("-DWEIGHT_INT8",), ()),
    "fp8": (torch.float8_e4m3fn, ("-DWEIGHT_FP8",), ()),
    # The same with AVX-512VL's 32 vector registers: blocks of 4 rows (small_gemm.c, EIGHT_BIT_ROWS).
    "int8-avx512": (torch.int8, ("-DWEIGHT_INT8", "-mavx512f", "-mavx512vl"), ("avx512f", "avx512vl")),
    "fp8-avx512": (torch.float8_e4m3fn, ("-DWEIGHT_FP8", "-mavx512f", "-mavx512vl"), ("avx512f", "avx512vl")),
    # int8 weights for a bf16 model on an AVX512_BF16 CPU: widened to bf16 (exactly) in registers and
    # multiplied by the bf16 rows with VDPBF16PS, as bf16-dot multiplies bf16 weights. Its panels are
    # uint8 tensors (the int8 values' bytes in the pairs layout), so that no other build reads them.
    "int8-dot": (torch.uint8, ("-DWEIGHT_INT8", "-DDOT_BF16", "-mavx512f", "-mavx512bf16", "-mavx512vl"), ("avx512f", "avx512vl", "avx512_bf16")),
    # The same for e4m3 weights (exact in bf16 too), widened in 16-bit lanes (AVX-512BW); its panels are tagged
    # float8_e4m3fnuz, a dtype no other build reads (the bytes are e4m3fn's: only unpack_quantized reads them).
    "fp8-dot": (torch.float8_e4m3fnuz, ("-DWEIGHT_FP8", "-DDOT_BF16", "-mavx512f", "-mavx512bf16", "-mavx512vl", "-mavx512bw"),
                ("avx512f", "avx512vl", "avx512bw", "avx512_bf16")),
    # int8 weights through VPDPBUSD (AVX512_VNNI): the rows as exact integers in three byte planes, the weights
    # stored q + 128 in quads of k (small_gemm.c, WEIGHT_VNNI), no widening. `int8-vnni` for float32 rows,
    # `int8-vnni-bf16` for a bf16 model's (its rows rounded to bf16 first, as int8-dot's). Their panels are tagged
    # float8_e5m2 / float8_e5m2fnuz, dtypes no other build reads (the bytes are q + 128: unpack_quantized reads them).
    "int8-vnni": (torch.float8_e5m2, VNNI_FLAGS, VNNI_NEEDS),
    "int8-vnni-bf16": (torch.float8_e5m2fnuz, (*VNNI_FLAGS, "-DROWS_BF16"), VNNI_NEEDS),
    # W8A8 (`--quantization w8a8_int8`): the same panels, each row quantized to int8 per row on the fly
    # (small_gemm.c, ACT_INT8): one plane of digits, one VPDPBUSD a product. `-bf16` for a bf16 model's rows.
    # Tagged float8_e8m0fnu / float4_e2m1fn_x2, one-byte dtypes no other build reads.
    "w8a8-vnni": (torch.float8_e8m0fnu, (*VNNI_FLAGS, "-DACT_INT8"), VNNI_NEEDS),
    "w8a8-vnni-bf16": (torch.float4_e2m1fn_x2, (*VNNI_FLAGS, "-DACT_INT8", "-DROWS_BF16"), VNNI_NEEDS),
    # The same panels and the same bits through AVX2 alone (small_gemm.c, VNNI_AVX2: VPSIGNB, VPMADDUBSW and
    # VPMADDWD for each VPDPBUSD), for CPUs without AVX512_VNNI; a host runs one of the two (_w8a8_kernel).
    "w8a8-avx2": (torch.float8_e8m0fnu, ("-DWEIGHT_VNNI", "-DACT_INT8", "-DVNNI_AVX2"), ()),
    "w8a8-avx2-bf16": (torch.float4_e2m1fn_x2, ("-DWEIGHT_VNNI", "-DACT_INT8", "-DVNNI_AVX2", "-DROWS_BF16"), ()),
    # The same panels and bits through AVX-VNNI (small_gemm.c, AVX_VNNI: one VEX VPDPBUSD on 256-bit vectors where
    # w8a8-avx2 takes three), for CPUs that have it, with AVX-512 or without (Intel's cores from Alder Lake, Sierra
    # Forest; Sapphire Rapids and Zen 5 have both it and AVX512_VNNI, and the measured choice takes the faster).
    "w8a8-avxvnni": (torch.float8_e8m0fnu, AVXVNNI_FLAGS, ("avx_vnni",)),
    "w8a8-avxvnni-bf16": (torch.float4_e2m1fn_x2, (*AVXVNNI_FLAGS, "-DROWS_BF16"), ("avx_vnni",)),
}
# A build that reads another's panels: the box's shared weights file is keyed by the panels' layout (SmallGemm.layout).
SAME_PANELS = {f"w8a8-{isa}{rows}": f"w8a8-vnni{rows}" for isa in ("avx2", "avxvnni") for rows in ("", "-bf16")}
W8A8_DTYPES = (torch.float8_e8m0fnu, torch.float4_e2m1fn_x2)
QUANTIZED_DTYPES = (torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz, *W8A8_DTYPES)
VNNI_DTYPES = (torch.float8_e5m2, torch.float8_e5m2fnuz, *W8A8_DTYPES)
# The builds whose panels carry a dtype of their own (a tag no other build reads), by that dtype.
# (W8A8's panels are read by the host's W8A8 build, _w8a8_kernel.)
TAGGED = {BUILDS[name][0]: name for name in ("int8-dot", "fp8-dot", "int8-vnni", "int8-vnni-bf16")}
SCALE_ROWS = 4  # an 8-bit panel's last rows: its 24 columns' float32 scales (96 bytes)
PANEL = 24  # NR in small_gemm.c: output columns per panel
# A row's product is shared between two cores from this weight size up: every one of
# SmolLM-135M's (its k and v grouped with q, as `packed_linear` groups them; its o, 0.66
# MB in bf16, since 2026-11-27) is; the test suite's tiny models' are not, as handing part
# of a small weight to the helper costs about what reading it does, and the helper then
# spins on a core that other processes want. At 1 MB (o on one core), SmolLM-135M's
# products in a step's order took 3.08 ms at one row with int8 layers, 4.78 in bf16,
# 5.42 and 6.58 at 8 rows; at 512 KB 2.93, 4.72, 5.36 and 6.42 (Zen 5 EPYC, interleaved
# in one process; 256 KB no better).
SPLIT_MIN_BYTES = 1 << 19


def worth_sharing(panels: torch.Tensor) -> bool:
    """Whether a product over these panels is large enough to share with the helper (SPLIT_MIN_BYTES). An
    8-bit weight counts at bf16's size: widening its values costs the reading cores more than reading them,
    so it pays to share from as many weights as a bf16 one. SmolLM-135M's q, o and down products (0.3-0.9 MB
    in int8) ran on one core; shared, its int8 decode step takes 5.63 ms at one row against 6.40, 11.2 against
    12.6 at 8 rows and 40.2 against 43.6 at 32 (`bench/decode_step.py --variants native,native-int8`, two
    rounds each, alternately; bf16's step meanwhile 7.4, 12.5-13.1 and 41-42 ms)."""
    return panels.numel() * max(panels.element_size(), 2) >= SPLIT_MIN_BYTES


# Products of up to this many rows are shared: every product the kernel computes.
# The helper runs at the lowest priority (SCHED_IDLE), so it only takes a core
# nothing else wants: in `disagg serve` the decode worker's steps use the prefill
# worker's core while it has no prompt, and the prefill worker's prompts the
# decode worker's core while it has no step. (When the helper ran at normal
# priority, sharing 2-64 rows cost tokens/s at 32 and 64 streams, where the
# prefill worker needs its core: bench/results/HISTORY.md, 2026-11-24, both cores shared at the
# lowest priority.)
SPLIT_MAX_ROWS = 64


class SmallGemm:
    """The loaded kernel: `pack` once per weight, then `product` per call.

    Up to SPLIT_MAX_ROWS rows times a weight of SPLIT_MIN_BYTES or more are
    computed on two cores, the caller's and a helper thread's, when the calling
    thread may run on more than one CPU (`small_gemm_split`; the same bits: two
    cores read and multiply faster than one). The helper runs at the lowest
    priority and the two claim panels one at a time, so a helper whose core is
    busy (a prefill beside the decode) leaves its share to the caller, which
    never waits for it. A thread pinned to one CPU (`--device-cpus`) keeps its
    rows on that CPU.
    """

    def __init__(self, library: ctypes.CDLL, name: str = "float32"):
        self.name = name
        self.layout = SAME_PANELS.get(name, name.removesuffix("-avx512"))  # an -avx512 build reads its AVX2 build's panels
        self.weight_dtype = BUILDS[name][0]
        self.pairs = name.endswith("-dot")  # panels hold pairs of k; the rows are rounded to bf16
        self.bf16_rows = self.pairs or name.endswith("-bf16")  # its rows are rounded to bf16 (a bf16 model's) before the products
        self.quads = self.weight_dtype in VNNI_DTYPES  # panels hold each column's k in fours, the values stored q + 128
        # k per 32-bit lane of a grouped layout (pack): 2 (pairs, VDPBF16PS), 4 (quads, VPDPBUSD); 0: plain panels
        self.lane_k = 4 if self.quads else 2 if self.pairs else 0
        self.scale_rows = SCALE_ROWS if self.weight_dtype in QUANTIZED_DTYPES else 0  # each panel's scales, after its K rows
        arguments = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
        self._call = library.small_gemm
        self._call.argtypes, self._call.restype = arguments, None
        self._split = library.small_gemm_split
        self._split.argtypes, self._split.restype = arguments, ctypes.c_int
        # A job of rows shared as a product's panels are (native_step.c's attention): its C entry, for the native step's struct.
        self._split_rows = library.small_gemm_split_rows
        # The helper's warming of the next product's weights while it waits (native_step.c): its C entry, for the same struct.
        self._warm = library.small_gemm_warm
        self._warm.argtypes, self._warm.restype = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long], None
        self._warmings_done = library.small_gemm_warmings_done
        self._warmings_done.argtypes, self._warmings_done.restype = [], ctypes.c_long
        self._helper_jobs = library.small_gemm_helper_jobs
        self._helper_jobs.argtypes, self._helper_jobs.restype = [], ctypes.c_long
        self._helper_cpus = library.small_gemm_helper_cpus
        self._helper_cpus.argtypes, self._helper_cpus.restype = [], ctypes.c_ulonglong
        self._limit_caller_panels = library.small_gemm_limit_caller_panels
        self._limit_caller_panels.argtypes, self._limit_caller_panels.restype = [ctypes.c_long], None
        self._helper_idle = library.small_gemm_helper_idle
        self._helper_idle.argtypes, self._helper_idle.restype = [], ctypes.c_int
        self._stall_helper = library.small_gemm_stall_helper
        self._stall_helper.argtypes, self._stall_helper.restype = [ctypes.c_long], None
        self._stall_started_helper = library.small_gemm_stall_started_helper
        self._stall_started_helper.argtypes, self._stall_started_helper.restype = [ctypes.c_long], None
        self._await_helper_claim = library.small_gemm_await_helper_claim
        self._await_helper_claim.argtypes, self._await_helper_claim.restype = [ctypes.c_int], None
        self._late_panels = library.small_gemm_late_panels
        self._late_panels.argtypes, self._late_panels.restype = [], ctypes.c_long
        self._thread = threading.local()  # per calling thread: whether it may run on more than one CPU
        self._meet_caller = library.small_gemm_meet_caller
        self._meet_caller.argtypes, self._meet_caller.restype = [], None
        # The AVX-512 float32 blocks' (WIDE_F32) rows from which a product reads its panels in pairs; None: other builds.
        self._pair_from = getattr(library, "small_gemm_pair_from", None)
        if self._pair_from is not None:
            self._pair_from.argtypes, self._pair_from.restype = [ctypes.c_long], None
        BUILT.append(self)

    def helper_jobs(self) -> int:
        """How many products the helper thread has computed a share of so far."""
        return self._helper_jobs()

    def limit_caller_panels(self, panels: int) -> None:
        """Tests: the caller of a split product computes at most this many panels
        (0: no limit) and the helper the rest, whenever it gets a core."""
        self._limit_caller_panels(panels)

    def helper_idle(self) -> bool:
        """Whether the helper thread runs at the lowest priority (SCHED_IDLE); False before it starts."""
        return bool(self._helper_idle())

    def stall_helper(self, seconds: float) -> None:
        """Tests: the helper sleeps this long after each panel it claims (0: never), as if it lost its core."""
        self._stall_helper(int(seconds * 1e9))

    def stall_started_helper(self, seconds: float) -> None:
        """Tests: the helper sleeps this long once it has started each unit (0: never), as if it lost its core in the middle of one."""
        self._stall_started_helper(int(seconds * 1e9))

    def await_helper_claim(self, on: bool) -> None:
        """Tests: the caller of a split product starts only once the helper has claimed a panel."""
        self._await_helper_claim(int(on))

    def warm(self, rows: int, in_features: int, address: int, out_features: int) -> None:
        """Asks the helper to warm what it would claim first of a product over the panels at address (tests; native_step.c calls the C side)."""
        self._warm(rows, in_features, address, out_features)

    def warmings_done(self) -> int:
        """How many warming requests the helper has prefetched to their end (tests)."""
        return self._warmings_done()

    def late_panels(self) -> int:
        """How many panels the helper computed after its caller had computed them itself."""
        return self._late_panels()

    def helper_cpus(self) -> set[int]:
        """The CPUs (below 64) the helper thread may run on: its last caller's; empty before it starts."""
        mask = self._helper_cpus()
        return {cpu for cpu in range(64) if mask >> cpu & 1}

    def meet_this_thread(self) -> None:
        """Settles, from the calling thread's CPUs as they are now, whether its products use two cores and
        which CPUs the helper runs on (see meet_this_thread below)."""
        self.splits_here()
        self._meet_caller()

    def pair_from(self, rows: int) -> None:
        """The AVX-512 float32 builds: products of this many rows or more read the panels in pairs (the same bits either way)."""
        if self._pair_from is None:
            raise ValueError(f"small_gemm: the {self.name} build does not pair its panels")
        self._pair_from(rows)

    def split_here(self, allowed: bool) -> None:
        """Overrides, for the calling thread, whether its single rows use two cores (benchmarks, tests)."""
        self._thread.splits = allowed

    def splits_here(self) -> bool:
        """Whether a row from this thread is computed on two cores: it may run on more
        than one CPU (read once per thread: a worker pins its device thread before its first step)."""
        answer = getattr(self._thread, "splits", None)
        if answer is None:
            answer = self._thread.splits = len(os.sched_getaffinity(0)) > 1 if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1) > 1
        return answer

    def shares(self, panels: torch.Tensor) -> bool:
        """Whether a product over these panels of up to SPLIT_MAX_ROWS rows, from this thread, is shared with the helper."""
        return worth_sharing(panels) and self.splits_here()

    def packed_k(self, in_features: int) -> int:
        """The panels' K: in_features, or rounded up to a multiple of 4 (pairs) or 8 (quads)."""
        group = 2 * self.lane_k  # k of one group of the layout (see pack)
        return -(-in_features // group) * group if group else in_features

    def panel_rows(self, in_features: int) -> int:
        """A panel's rows: packed_k, and an 8-bit build's scales."""
        return self.packed_k(in_features) + self.scale_rows

    def pack_quantized(self, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """An 8-bit weight (values [out, in], int8 or float8_e4m3fn; scale [out] float32) -> panels
        [ceil(out / 24), in + 4, 24] of the values' dtype: each panel's [in][24] values, then its
        columns' 24 float32 scales as 96 bytes (small_gemm.c, SCALE_ROWS); columns past `out` zero."""
        if values.element_size() != 1 or not self.scale_rows or (values.dtype == torch.float8_e4m3fn) != self.name.startswith("fp8"):
            raise ValueError(f"small_gemm {self.name}: cannot pack {values.dtype} values")
        out_features, in_features = values.shape
        raw = (values.view(torch.int8).to(torch.int16) + 128).to(torch.uint8) if self.quads else values.view(torch.uint8)
        body = self.pack(raw)  # [panels, K, 24] bytes, in this build's layout
        panels = body.shape[0]
        scales = torch.zeros(panels * PANEL, dtype=torch.float32)
        scales[:out_features] = scale
        tail = scales.view(torch.uint8).view(panels, SCALE_ROWS, PANEL)
        return torch.cat([body, tail], dim=1).contiguous().view(self.weight_dtype)

    def unpack_quantized(self, panels: torch.Tensor, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(values [out, in], scale [out] float32) back from `pack_quantized`'s panels (copies)."""
        count, k = panels.shape[0], self.packed_k(in_features)
        raw = panels.view(torch.uint8)
        values = self.unpack(raw[:, :k].contiguous(), out_features, in_features, values_only=True).contiguous()
        if self.quads:
            values = (values.to(torch.int16) - 128).to(torch.int8).view(torch.uint8)
        scale = raw[:, k:].contiguous().view(torch.float32).reshape(count * PANEL)[:out_features].clone()
        return values.view(torch.float8_e4m3fn if self.name.startswith("fp8") else torch.int8), scale

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """nn.Linear's weight [out, in] -> panels [ceil(out / 24), K, 24], the columns past `out` zero.
        Grouped layouts (lane_k: a 32-bit lane holds a column's lane_k consecutive k, its element pairs or
        quads) round K up to groups of 2 x lane_k k (zero rows) and lay each group of a panel out as the
        columns 0-15 of its two lanes' k ([2][16][lane_k]), then columns 16-23 with each column's two side
        by side ([8][2][lane_k]), so no load crosses a cache line (small_gemm.c, DOT_BF16 and WEIGHT_VNNI)."""
        out_features, in_features = weight.shape
        panels, k = -(-out_features // PANEL), self.packed_k(in_features)
        padded = weight.new_zeros(panels * PANEL, k)
        padded[:out_features, :in_features] = weight
        lane = self.lane_k
        if lane:
            groups = padded.view(panels, PANEL, k // (2 * lane), 2, lane).permute(0, 2, 3, 1, 4)  # [panel, group, half, column, k]
            low = groups[:, :, :, :16].reshape(panels, k // (2 * lane), -1)
            high = groups[:, :, :, 16:].transpose(2, 3).reshape(panels, k // (2 * lane), -1)  # [column, half, k]: a column's two side by side
            return torch.cat([low, high], dim=2).view(panels, k, PANEL)
        return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()

    def unpack(self, panels: torch.Tensor, out_features: int, in_features: int, values_only: bool = False) -> torch.Tensor:
        """The weight [out, in] back from `pack`'s panels (a copy); an 8-bit build's dequantized, in float32
        (values_only: the layout undone over the K rows given, nothing else)."""
        if self.scale_rows and not values_only:
            values, scale = self.unpack_quantized(panels, out_features, in_features)
            return values.float() * scale[:, None]
        count, k, lane = panels.shape[0], panels.shape[1], self.lane_k
        if lane:
            groups = panels.reshape(count, k // (2 * lane), 2 * lane * PANEL)  # per group: columns 0-15's 32 x lane elements, then 16-23's
            low = groups[..., : 32 * lane].reshape(count, k // (2 * lane), 2, 16, lane)
            high = groups[..., 32 * lane :].reshape(count, k // (2 * lane), 8, 2, lane).transpose(2, 3)
            weight = torch.cat([low, high], dim=3).permute(0, 3, 1, 2, 4).reshape(count * PANEL, k)
        else:
            weight = panels.transpose(1, 2).reshape(count * PANEL, k)
        return weight[:out_features, :in_features]

    def product(self, rows: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
        """rows [n, in] float32 -> [n, out] float32 (into `out`, contiguous, if given); panels of this build's weight dtype."""
        rows = rows.contiguous()
        n, in_features = rows.shape
        # The C side reads raw pointers: a shape it was not packed for would read past the buffers, not fail.
        bias_fits = bias is None or (bias.shape == (out_features,) and bias.dtype == torch.float32)
        fits = panels.shape[1] == self.panel_rows(in_features) and out_features <= panels.shape[0] * PANEL and bias_fits
        if not fits or rows.dtype != torch.float32 or panels.dtype != self.weight_dtype or not panels.is_contiguous():
            raise ValueError(
                f"small_gemm: rows {tuple(rows.shape)} {rows.dtype} x {out_features} outputs do not fit panels {tuple(panels.shape)} {panels.dtype}"
            )
        if out is None:
            out = torch.empty(n, out_features, dtype=torch.float32)
        elif out.shape != (n, out_features) or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(f"small_gemm: out {tuple(out.shape)} {out.dtype} is not a contiguous [{n}, {out_features}] float32")
        call = self._split if n <= SPLIT_MAX_ROWS and self.shares(panels) else self._call
        call(rows.data_ptr(), n, in_features, panels.data_ptr(), out_features, None if bias is None else bias.data_ptr(), out.data_ptr())
        return out


BUILT: list[SmallGemm] = []  # every kernel loaded in this process


def meet_this_thread() -> None:
    """Before threads.on_the_teams_cpu keeps the calling thread on one CPU: each kernel decides once per thread
    whether its products use two cores, and gives its helper the CPUs of the thread that first shares one, both
    from the CPUs the thread has at that moment. A prefill worker whose first prompt is long (transformers'
    modules, inside on_the_teams_cpu) would otherwise keep every later prefill's products on one core, or its
    helper on the caller's one CPU."""
    for kernel in BUILT:
        kernel.meet_this_thread()


def quantized_kernel(values_dtype: torch.dtype, rows_dtype: torch.dtype, activations: str | None = None) -> SmallGemm | None:
    """The kernel for 8-bit weights multiplied by rows of a model of rows_dtype. W8A8 (activations "int8"):
    `w8a8-vnni` (AVX512_VNNI), `w8a8-avxvnni` (AVX-VNNI) or `w8a8-avx2` (`-bf16` for a bf16 model's rows), the same
    bits, the fastest here by a short measured product at first use (`DISAGG_W8A8_KERNEL=vnni|avxvnni|avx2` names
    one). int8: the faster here of
    VPDPBUSD over the rows as exact integers (`int8-vnni`, `int8-vnni-bf16`: AVX512_VNNI CPUs) and, for a bf16
    model, VDPBF16PS (`int8-dot`: AVX512_BF16), else the weights widened to float32, by a short measured
    product at first use (`DISAGG_INT8_KERNEL=vnni|dot|widen` names one); fp8: VDPBF16PS for a bf16 model where
    the CPU has it (its rows are bf16 already: the products stay exact), else widened to float32."""
    if activations == "int8":
        return _w8a8_kernel(rows_dtype == torch.bfloat16) if values_dtype == torch.int8 else None
    if values_dtype == torch.int8:
        return _int8_kernel(rows_dtype == torch.bfloat16)
    if values_dtype == torch.float8_e4m3fn and rows_dtype == torch.bfloat16 and build_kernel("fp8-dot") is not None:
        return build_kernel("fp8-dot")
    return kernel(values_dtype)


@functools.cache
def _int8_kernel(bf16_rows: bool) -> SmallGemm | None:
    widen = "int8-avx512" if build_kernel("int8-avx512") is not None else "int8"
    builds = {"vnni": "int8-vnni-bf16" if bf16_rows else "int8-vnni", "dot": "int8-dot", "widen": widen}
    if not bf16_rows:  # int8-dot rounds its rows to bf16: a float32 model's would lose their bits
        del builds["dot"]
    return chosen_build(f"int8 ({'bf16' if bf16_rows else 'float32'} rows)", "DISAGG_INT8_KERNEL", builds)


@functools.cache
def _w8a8_kernel(bf16_rows: bool) -> SmallGemm | None:
    suffix = "-bf16" if bf16_rows else ""
    builds = {isa: f"w8a8-{isa}{suffix}" for isa in ("vnni", "avxvnni", "avx2")}
    return chosen_build(f"W8A8 ({'bf16' if bf16_rows else 'float32'} rows)", "DISAGG_W8A8_KERNEL", builds)


def kernel(weight_dtype: torch.dtype = torch.float32) -> SmallGemm | None:
    """The kernel for weights of this dtype (float32, bfloat16, or 8-bit: int8, float8_e4m3fn), or None where none runs here (logged once)."""
    return _kernel(weight_dtype)  # one object per dtype, however it is asked for


# The dtypes with two builds, chosen per host at first use: (what the log calls its products, the
# variable that names one instead, its values' builds with the wider first). Either runs the same
# panels, so a worker need not know which chose.
CHOICES = {
    torch.bfloat16: ("bf16", "DISAGG_BF16_KERNEL", {"dot": "bf16-dot", "widen-avx512": "bf16-widen-avx512", "widen": "bf16-widen"}),
    torch.float32: ("float32", "DISAGG_F32_KERNEL", {"avx512": "float32-avx512", "avx2": "float32"}),
}


@functools.cache
def _kernel(weight_dtype: torch.dtype) -> SmallGemm | None:
    if weight_dtype in CHOICES:
        return chosen_build(*CHOICES[weight_dtype])
    if weight_dtype in W8A8_DTYPES:
        return _w8a8_kernel(weight_dtype == BUILDS["w8a8-vnni-bf16"][0])
    if weight_dtype in TAGGED:
        return build_kernel(TAGGED[weight_dtype])
    if weight_dtype in QUANTIZED_DTYPES:
        name = "int8" if weight_dtype == torch.int8 else "fp8"
        return build_kernel(f"{name}-avx512") or build_kernel(name)  # the wider build where the CPU has it
    return None


def chosen_build(products: str, variable: str, builds: dict[str, str]) -> SmallGemm | None:
    """The build the variable names, else the faster of those the CPU runs by a short measured product (logged with both times)."""
    named = os.environ.get(variable)
    if named:
        if named not in builds:
            raise BadKernelSetting(f"{variable} must be {' or '.join(builds)}, not {named!r}")
        chosen = build_kernel(builds[named])
        log.info("%s products: %s", products, f"the {builds[named]} kernel ({variable})" if chosen else f"{builds[named]} cannot run here")
        return chosen
    candidates = [k for k in map(build_kernel, builds.values()) if k is not None]
    if len(candidates) < 2:
        if candidates:
            log.info("%s products: the %s kernel (the only one this CPU runs)", products, candidates[0].name)
        return candidates[0] if candidates else None
    times = {k.name: measured_seconds(k) for k in candidates}
    chosen = min(candidates, key=lambda k: times[k.name])
    log.info(
        "%s products: the %s kernel, faster here (%s; 1 and 16 rows over a [%d, %d] weight)",
        products, chosen.name, ", ".join(f"{name} {seconds * 1e3:.2f} ms" for name, seconds in times.items()), *CHOICE_SHAPE,
    )
    return chosen


def host_note(weight_dtype: torch.dtype) -> str:
    """What this host's few-row products over weights of this dtype run on, for log lines: the build
    and the instructions it uses (AVX-512 where the CPU has it), or that none runs here."""
    chosen = kernel(weight_dtype)
    if chosen is None:
        return f"no build for {weight_dtype} runs here: it needs AVX2, FMA and a C compiler"
    needs = BUILDS[chosen.name][2]
    instructions = "AVX512_BF16" if "avx512_bf16" in needs else "AVX-512" if "avx512f" in needs else "AVX-VNNI" if "avx_vnni" in needs else "AVX2"
    return f"the {chosen.name} build here, {instructions}"


@functools.cache
def build_kernel(name: str) -> SmallGemm | None:
    """One build of the kernel (BUILDS), or None where it cannot run here (logged once)."""
    _, flags, needs = BUILDS[name]
    missing = [feature for feature in needs if feature not in cpu_flags()]
    if missing:
        log.info("few-row kernel %s not used: the CPU lacks %s", name, ", ".join(missing))
        return None
    library = load_library(SOURCE, FLAGS + flags, (), f"few-row kernel {name} not used")
    if library is None:
        return None
    # Split products go to the caller and the torch threads' worth of helpers beside it
    # (one at least: a worker on one torch thread still takes an idle second core).
    library.small_gemm_set_helpers.argtypes, library.small_gemm_set_helpers.restype = [ctypes.c_long], None
    library.small_gemm_set_helpers(max(1, torch.get_num_threads() - 1))
    built = SmallGemm(library, name)
    if built._pair_from is not None:
        choose_pairing(built)
    return built


# Where the AVX-512 float32 blocks start reading panels in pairs (small_gemm.c, WIDE_F32): from 2 rows, or from
# 16. Measured on SmolLM-135M's products, the same bits either way: on a Zen 5 EPYC pairs at 4 and 8 rows were
# 6-30% slower than single panels; on an Ice Lake Xeon 1.06x faster at 2-3 rows and 1.10-1.21x at 4-12.
PAIR_FROM = (2, 16)


def choose_pairing(candidate: SmallGemm) -> None:
    """Sets the rows from which this build pairs its panels: `DISAGG_PAIR_FROM`, else the faster of PAIR_FROM
    over 8 rows (logged with both times)."""
    named = os.environ.get("DISAGG_PAIR_FROM")
    if named:
        if not named.isdigit() or int(named) < 2:
            raise BadKernelSetting(f"DISAGG_PAIR_FROM must be a number of rows, 2 or more, not {named!r}")
        candidate.pair_from(int(named))
        log.info("%s products: panels in pairs from %s rows (DISAGG_PAIR_FROM)", candidate.name, named)
        return
    times, inputs = {}, choice_inputs(candidate)
    for _ in range(2):  # alternately: a shared host's speed moves within the measurement
        for rows in PAIR_FROM:
            candidate.pair_from(rows)
            times[rows] = min(times.get(rows, float("inf")), measured_seconds(candidate, (8,), inputs))
    chosen = min(PAIR_FROM, key=lambda rows: times[rows])
    candidate.pair_from(chosen)
    log.info("%s products: panels in pairs from %d rows, faster here at 8 rows (%s)", candidate.name, chosen,
             ", ".join(f"from {rows}: {seconds * 1e3:.2f} ms" for rows, seconds in times.items()))


# The start-up measurement's weight: larger than the caches' share a core gets (weights stream
# from memory in a decode step), small enough to take a few milliseconds.
CHOICE_SHAPE = (4096, 1024)


def measured_seconds(candidate: SmallGemm, counts: tuple[int, ...] = (1, 16), inputs: tuple | None = None) -> float:
    """The best of three: one row, then 16 (or `counts` rows), through this kernel on this thread alone (an
    8-bit build's over int8 values and their scales); `inputs` from choice_inputs, made here if not given."""
    panels, rows, out = inputs or choice_inputs(candidate)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for count in counts:
            candidate._call(rows.data_ptr(), count, CHOICE_SHAPE[1], panels.data_ptr(), CHOICE_SHAPE[0], None, out.data_ptr())
        best = min(best, time.perf_counter() - started)
    return best


def choice_inputs(candidate: SmallGemm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A CHOICE_SHAPE weight packed for this build, 16 rows and their output."""
    generator = torch.Generator().manual_seed(0)
    if candidate.scale_rows:
        values = torch.randint(-127, 128, CHOICE_SHAPE, dtype=torch.int8, generator=generator)
        panels = candidate.pack_quantized(values, torch.rand(CHOICE_SHAPE[0], generator=generator) / 64)
    else:
        panels = candidate.pack(torch.randn(CHOICE_SHAPE, generator=generator).to(candidate.weight_dtype))
    return panels, torch.randn(16, CHOICE_SHAPE[1], generator=generator), torch.empty(16, CHOICE_SHAPE[0])


def load_library(source: pathlib.Path, flags: tuple[str, ...], libraries: tuple[str, ...], unused: str) -> ctypes.CDLL | None:
    """A C source of this package built (once, cached) and loaded, or None with one
    log line starting with `unused` where it cannot run here: no AVX2, no compiler
    and nothing cached, or a build that fails (slot_attention.c loads the same way)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        log.info("%s: the CPU has no AVX2 (PyTorch reports %s)", unused, capability)
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler and not built(source, flags, libraries).exists():
        log.info("%s: no C compiler found (set CC)", unused)
        return None
    try:
        return ctypes.CDLL(str(build(compiler, source, flags, libraries)))
    except subprocess.CalledProcessError as exc:
        log.warning("%s: %s failed: %s", unused, compiler, exc.stderr.decode(errors="replace").strip()[-500:])
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("%s: building or loading it failed: %s", unused, exc)
    return None


def built(source: pathlib.Path = SOURCE, flags: tuple[str, ...] = FLAGS, libraries: tuple[str, ...] = ()) -> pathlib.Path:
    """Where this source's library is cached (named by a hash of the source, the flags and the libraries)."""
    key = hashlib.sha256(source.read_bytes() + " ".join(flags + libraries).encode()).hexdigest()[:16]
    return cache_dir() / source.stem / f"{source.stem}-{key}.so"


def build(compiler: str | None, source: pathlib.Path = SOURCE, flags: tuple[str, ...] = FLAGS, libraries: tuple[str, ...] = ()) -> pathlib.Path:
    """The shared library, compiled unless the cache already holds this source's.
    libraries ("-lm") go after the
    source, where a linker that drops unneeded libraries still sees them needed."""
    target = built(source, flags, libraries)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Compiled beside the target and renamed into place: processes starting together never load half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        partial = pathlib.Path(scratch) / target.name
        subprocess.run([compiler, *flags, "-o", str(partial), str(source), *libraries], check=True, capture_output=True, timeout=120)
        os.replace(partial, target)
    log.info("built %s: %s", source.name, target)
    return target
