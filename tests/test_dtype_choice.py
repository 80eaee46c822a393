"""--dtype auto: bf16 where the CPU computes it natively, float32 elsewhere, the checkpoint's own on CUDA."""

import json
import logging
import pathlib

import pytest
from conftest import tiny_model

from disagg.cli.flags import add_model_flags
from disagg.engine import dtype_choice
from disagg.engine.backends import load_backend


@pytest.mark.parametrize(
    "flags, dtype, named",
    [
        ({"avx2", "fma", "avx512f", "avx512_bf16"}, "bfloat16", "AVX512_BF16"),  # a Zen 4 EPYC, a Cooper Lake Xeon
        ({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, "bfloat16", "AMX_BF16"),  # a Sapphire Rapids Xeon
        ({"avx2", "fma"}, "float32", "without AVX512_BF16 or AMX"),  # an AVX2-only EPYC
        (set(), "float32", "bf16 would be emulated"),  # no flags read (not Linux)
    ],
)
def test_a_cpu_gets_bf16_only_where_it_computes_bf16_natively(flags, dtype, named, monkeypatch):
    monkeypatch.setattr(dtype_choice.platform, "machine", lambda: "x86_64")
    chosen, why = dtype_choice.choose_dtype("torch", "cpu", flags=flags)
    assert chosen == dtype and named in why


def test_neuron_gets_bf16_and_cuda_the_checkpoint_s_own(tmp_path):
    assert dtype_choice.choose_dtype("neuron")[0] == "bfloat16"
    for named in ("float16", "float32"):
        checkpoint = tmp_path / named
        checkpoint.mkdir()
        config = json.loads((pathlib.Path(tiny_model("llama")) / "config.json").read_text())
        config.pop("torch_dtype", None)
        (checkpoint / "config.json").write_text(json.dumps({**config, "dtype": named}))
        assert dtype_choice.choose_dtype("torch", "cuda", str(checkpoint)) == (named, "the checkpoint's own dtype, on CUDA")
    assert dtype_choice.choose_dtype("torch", "cuda:0", None)[0] == "bfloat16"


def test_auto_is_the_workers_default_and_is_logged_with_its_reason(caplog):
    import argparse

    parser = argparse.ArgumentParser()
    add_model_flags(parser)
    assert parser.parse_args([]).dtype == "auto"
    with caplog.at_level(logging.INFO, logger="disagg.engine.backends"):
        backend = load_backend("torch", model=tiny_model("llama"), dtype="auto", max_seq_len=64)
    chosen, why = dtype_choice.choose_dtype("torch", "cpu")
    assert backend.info.dtype == chosen
    assert f"dtype auto: {chosen} ({why})" in caplog.text
