"""The compiled, bucketed decode step (torch backend) in one process, against generate()."""

import pytest
import torch
from conftest import reference, tiny_model
from test_backend import PROMPTS, run_batch
from torch._dynamo.utils import counters

from disagg.engine.backends import load_backend
from disagg.engine.backends.compiled import BadBuckets, bucket_for, check_buckets, default_batch_buckets, powers_of_two

# Plain attention, and sliding-window layers (alone, and between full layers)
# that the bucket's whole KV length reaches past: the model's own mask must cut.
COMPILED_ARCHITECTURES = ("llama", "mistral-sw", "gemma2-sw")
# On CUDA the compiled step replays a CUDA graph per bucket; run wherever a GPU is at hand.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("architecture", COMPILED_ARCHITECTURES)
def test_compiled_bucketed_decode_equals_generate(architecture, device):
    ref = reference(architecture)
    backend = load_backend(
        "torch", model=tiny_model(architecture), dtype="float32", device=device, max_seq_len=128, compile=True,
        batch_buckets=(2, 4, 6), token_buckets=(32, 64, 128),
    )
    torch._dynamo.reset()  # an earlier test's compile of the same model code would be reused: counted from none
    graphs = counters["stats"]["unique_graphs"]
    backend.allocate_slots(6)
    # Every bucket is a shape of one graph, the last KV-length bucket (the cache's whole length) too.
    assert counters["stats"]["unique_graphs"] - graphs == 1
    assert backend.cache.keys[0].shape[0] == 7 and backend.cache.keys[0].device.type == device  # the scratch slot the padding rows write
    max_new = [6, 11, 17, 40]
    # Slots 1, 4, 2, 5: padding rows (0 and 3) sit between decoding rows; the
    # batch shrinks through the buckets as sequences finish, and the longest
    # crosses from the 32 into the 64 KV-length bucket.
    out, _, _ = run_batch(backend, ref, PROMPTS, max_new, async_mode=True, slots=[1, 4, 2, 5])
    for i, prompt in enumerate(PROMPTS):
        assert out[str(i)] == ref.greedy(prompt, max_new[i]), prompt


def test_padding_rows_never_write_a_slot_that_is_not_decoding():
    backend = load_backend("torch", model=tiny_model("llama"), dtype="float32", max_seq_len=128, compile=True, batch_buckets=(4,), token_buckets=(128,))
    backend.allocate_slots(4)
    # Slot 0 holds a landed prompt but has not joined; slot 3 decodes, so the step runs batch bucket 4.
    for cache in (*backend.cache.keys, *backend.cache.values):
        cache[:4].fill_(0.5)
    ref = reference("llama")
    out, _, _ = run_batch(backend, ref, [PROMPTS[0]], [3], async_mode=False, slots=[3])
    assert out["0"] == ref.greedy(PROMPTS[0], 3)
    for cache in (*backend.cache.keys, *backend.cache.values):
        assert bool((cache[:3] == 0.5).all())


def test_buckets():
    assert powers_of_two(1, 6) == (1, 2, 4, 6) and powers_of_two(2, 64) == (2, 4, 8, 16, 32, 64)
    assert default_batch_buckets(6, torch.device("cpu")) == (1, 2, 4, 6) and default_batch_buckets(6, torch.device("cuda")) == (2, 4, 6)
    assert default_batch_buckets(1, torch.device("cuda")) == (1,)
    assert powers_of_two(128, 2048) == (128, 256, 512, 1024, 2048)
    assert powers_of_two(128, 100) == (100,)
    assert bucket_for((1, 2, 4, 6), 3) == 4 and bucket_for((1, 2, 4, 6), 6) == 6
    with pytest.raises(BadBuckets, match="--token-buckets .*must be 1024"):
        check_buckets("KV-length", (128, 512), 1024, "--token-buckets")
    with pytest.raises(BadBuckets, match="strictly ascending"):
        check_buckets("batch", (4, 2, 8), 8, "--batch-buckets")


def test_compiling_is_the_default_on_cuda_only():
    from decode_worker.__main__ import parse_config

    model = tiny_model("llama")
    assert parse_config(["--model", model]).compile is None
    assert parse_config(["--model", model, "--compile", "--batch-buckets", "2,8", "--token-buckets", "128,512"]).batch_buckets == (2, 8)
    backend = load_backend("torch", model=model, dtype="float32", compile=None)
    backend.allocate_slots(2)
    assert backend.compiled is None and backend.cache.keys[0].shape[0] == 2  # eager on CPU: no scratch slot


def test_a_compiled_step_that_differs_from_eager_is_refused_at_start_up(monkeypatch):
    from disagg.engine.backends.architectures import UnsupportedModel
    from disagg.engine.backends.slot_kv_cache import BucketDecodeCache

    # Every row's query as if at position 0: the mask hides the rows' history. Dynamo
    # forgets the graphs earlier tests traced, so this one is traced with the patch.
    torch._dynamo.reset()
    monkeypatch.setattr(BucketDecodeCache, "get_query_offset", lambda self, layer_idx=0: torch.zeros_like(self.step.positions))
    backend = load_backend("torch", model=tiny_model("llama"), dtype="float32", max_seq_len=128, compile=True, batch_buckets=(2,), token_buckets=(128,))
    with pytest.raises(UnsupportedModel, match="compiled decode step does not equal the eager one"):
        backend.allocate_slots(2)
