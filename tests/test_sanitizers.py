"""The few-row kernel's split product (the caller and its helper threads, lock-free
claims, late helpers) built with AddressSanitizer and ThreadSanitizer and driven by
tests/sanitize/split_driver.c: every product the same bits as the kernel alone, every
job of rows (small_gemm_split_rows, the native step's shared attention) the rows
computed in turn, and no report from the sanitizer. Each build of the kernel (float32, float32-avx512, bf16-widen, bf16-dot)."""

import functools
import os
import pathlib
import shutil
import subprocess

import pytest

from disagg.engine.cpu_kernels import small_gemm
from disagg.engine.dtype_choice import cpu_flags

DRIVER = pathlib.Path(__file__).with_name("sanitize") / "split_driver.c"
COMPILER = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
BYTES_PER_WEIGHT = {"float32": 4, "float32-avx512": 4, "bf16-widen": 2, "bf16-widen-avx512": 2, "bf16-dot": 2}


def sanitized_driver(tmp_path: pathlib.Path, sanitizer: str, build: str) -> pathlib.Path:
    _, flags, needs = small_gemm.BUILDS[build]
    if not COMPILER:
        pytest.skip("no C compiler")
    if not {"avx2", "fma"} <= cpu_flags() or any(feature not in cpu_flags() for feature in needs):
        pytest.skip(f"this CPU does not run the {build} build")
    program = tmp_path / f"driver-{sanitizer}-{build}"
    command = [COMPILER, "-O1", "-g", f"-fsanitize={sanitizer}", "-fno-omit-frame-pointer", "-mavx2", "-mfma", "-pthread", *flags,
               "-o", str(program), str(DRIVER), str(small_gemm.SOURCE)]
    built = subprocess.run(command, capture_output=True, text=True, timeout=180)
    if built.returncode != 0 and "-l" in built.stderr and ("asan" in built.stderr or "tsan" in built.stderr):
        pytest.skip(f"the compiler has no {sanitizer} sanitizer runtime: {built.stderr.strip()[-200:]}")
    assert built.returncode == 0, built.stderr
    return program


@functools.cache
def without_aslr() -> tuple[str, ...]:
    """The driver's command prefix that turns off address-space randomisation, where setarch can: ThreadSanitizer's
    runtime maps its shadow memory at fixed ranges, and a randomised mapping that lands in one fails the run at
    start ("unexpected memory mapping", more often where the kernel randomises more bits), a failure of the
    runtime and not of the kernel under test."""
    setarch = shutil.which("setarch")
    if setarch and subprocess.run([setarch, os.uname().machine, "-R", "true"], capture_output=True).returncode == 0:
        return (setarch, os.uname().machine, "-R")
    return ()


@pytest.mark.parametrize("build", sorted(BYTES_PER_WEIGHT))
@pytest.mark.parametrize("sanitizer", ["address", "thread"])
def test_the_split_product_is_clean_under_the_sanitizers(tmp_path, sanitizer, build):
    program = sanitized_driver(tmp_path, sanitizer, build)
    env = {**os.environ, "ASAN_OPTIONS": "halt_on_error=1:detect_leaks=1", "TSAN_OPTIONS": "halt_on_error=1:report_signal_unsafe=0"}
    # Three helpers: more than this host's cores, so helpers lose their core mid-product as on a busy machine.
    ran = subprocess.run([*without_aslr(), str(program), "3", str(BYTES_PER_WEIGHT[build]), "stall"], capture_output=True, text=True, timeout=600, env=env)
    assert ran.returncode == 0, ran.stderr[-4000:]
    assert "Sanitizer" not in ran.stderr, ran.stderr[-4000:]
    jobs = int(ran.stdout.split("ok: ", 1)[1].split()[0])
    assert jobs > 0  # the helpers computed shares: the rounds where the caller takes one panel need them
