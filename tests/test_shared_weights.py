"""The box's packed weights file (disagg/engine/shared_weights.py): written once, mapped by every
worker of the machine, and never served when it is torn, changed or another version's."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import reference, tiny_model
from test_backend import PROMPTS, run_batch

import disagg
from disagg.engine import shared_weights
from disagg.engine.backends import load_backend
from disagg.engine.cache_dir import cache_dir
from disagg.engine.cpu_kernels import small_gemm
from disagg.engine.cpu_kernels.packed_linear import PackedLinear

pytestmark = pytest.mark.skipif(small_gemm.kernel() is None, reason="no AVX2 CPU or C compiler: the kernel's panels are not made here")


@pytest.fixture
def weights_dir(tmp_path, monkeypatch):
    """The files of this test alone (the kernels stay in the machine's cache)."""
    monkeypatch.setattr(shared_weights, "directory", lambda key: tmp_path / key)
    return tmp_path


def load():
    return load_backend("torch", model=tiny_model("llama"), dtype="float32", max_seq_len=128)


def decodes_as_generate(backend) -> bool:
    ref = reference("llama")
    backend.allocate_slots(len(PROMPTS))
    max_new = [5, 9, 13, 21]
    out, _, _ = run_batch(backend, ref, PROMPTS, max_new, async_mode=True)
    return all(out[str(i)] == ref.greedy(prompt, max_new[i]) for i, prompt in enumerate(PROMPTS))


def mapped_file(tensor: torch.Tensor) -> str | None:
    """The file whose mapping holds the tensor's first byte (/proc/self/maps), or None (anonymous memory)."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return fields[5] if len(fields) > 5 and fields[5].startswith("/") else None
    return None


def the_file(weights_dir) -> str:
    (found,) = weights_dir.glob("*/weights.bin")
    return str(found)


def test_the_first_backend_writes_the_file_and_the_next_maps_it(weights_dir):
    first = load()
    assert first.weights_note.startswith("wrote the box's packed weights file"), first.weights_note
    second = load()
    assert second.weights_note.startswith("mapped the box's packed weights file"), second.weights_note
    path = the_file(weights_dir)
    for backend in (first, second):
        model = backend.model
        linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
        # Every tensor it serves from lies in the file: each linear's panels (one layout, no oneDNN copy), the
        # groups' spans, the embedding and the norms.
        assert linears and all(mapped_file(m.panels) == path and m.onednn is None for m in linears)
        assert all(mapped_file(m.shared.panels) == path for m in linears if m.shared is not None)
        assert mapped_file(model.model.embed_tokens.weight) == path and mapped_file(model.model.norm.weight) == path
        assert decodes_as_generate(backend)


def damage_truncated(path):
    os.truncate(path, os.path.getsize(path) - 4096)


def damage_flipped(path):
    # The middle of the payload overwritten with 0xFF (NaN in float32): served, the logits would be NaN.
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(b"\xff" * 8192)


def damage_other_key(path):
    with open(path, "r+b") as f:
        head = f.read(1 << 16)
        start = head.index(b'"key": "') + len(b'"key": "')
        f.seek(start)
        f.write(b"0" * 24)  # the same length: the rest of the header reads as before


def damage_other_format(path):
    with open(path, "r+b") as f:
        head = f.read(1 << 16)
        f.seek(head.index(f'"format": {shared_weights.FORMAT}'.encode()) + len(b'"format": '))
        f.write(b"9")


@pytest.mark.parametrize("damage, reason", [
    (damage_truncated, "torn"),
    (damage_flipped, "CRC-32"),
    (damage_other_key, f"not format {shared_weights.FORMAT} for"),
    (damage_other_format, "it is format 9"),
])
def test_a_torn_changed_or_foreign_file_is_written_anew_and_never_served(weights_dir, caplog, damage, reason):
    load()
    path = the_file(weights_dir)
    damage(path)
    with pytest.raises(shared_weights.UnusableFile):
        shared_weights.read(shared_weights.weights_path(os.path.basename(os.path.dirname(path))), os.path.basename(os.path.dirname(path)))
    backend = load()
    assert any("not used" in r.getMessage() and reason in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert backend.weights_note.startswith("wrote the box's packed weights file"), backend.weights_note
    key = os.path.basename(os.path.dirname(path))
    assert shared_weights.read(path, key).nbytes > 0  # whole again
    assert decodes_as_generate(backend)


def test_another_version_of_the_project_or_dtype_is_another_file_and_replaces_the_old_one(weights_dir, monkeypatch):
    model = tiny_model("llama")
    key = shared_weights.key_for(model, torch.float32)
    assert key == shared_weights.key_for(model, torch.float32) != shared_weights.key_for(model, torch.bfloat16)
    old = load()
    old_file = the_file(weights_dir)
    monkeypatch.setattr(disagg, "__version__", disagg.__version__ + ".post1")
    assert shared_weights.key_for(model, torch.float32) != key
    new = load()
    assert new.weights_note.startswith("wrote") and the_file(weights_dir) != old_file  # the older release's file is gone
    assert decodes_as_generate(old) and decodes_as_generate(new)  # a worker still mapping it keeps its pages


WORKER = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    from disagg.engine.backends import load_backend
    backend = load_backend("torch", model={model!r}, dtype="float32", max_seq_len=128)
    # Nothing keeps the loaded nn.Linear weights: every live tensor of a linear's shape lies in the file's mapping.
    import gc, torch
    from disagg.engine.cpu_kernels.packed_linear import PackedLinear
    shapes = {{(m.out_features, m.in_features) for m in backend.model.modules() if isinstance(m, PackedLinear)}}
    maps = [line.split() for line in open("/proc/self/maps")]
    in_file = lambda t: any(int(m[0].split("-")[0], 16) <= t.data_ptr() < int(m[0].split("-")[1], 16) and m[-1].endswith("weights.bin") for m in maps)
    gc.collect()
    loose = [tuple(t.shape) for t in gc.get_objects() if isinstance(t, torch.Tensor) and tuple(t.shape) in shapes and not in_file(t)]
    print(json.dumps({{"note": backend.weights_note, "loose": loose}}), flush=True)
    sys.stdin.readline()  # both loaded: measure
    fields, inside = {{}}, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if "-" in line.split()[0] and ":" not in line.split()[0]:
                inside = line.rstrip().endswith("weights.bin")
            elif inside and line.split()[0].rstrip(":") in ("Rss", "Pss", "Shared_Clean"):
                name = line.split()[0].rstrip(":")
                fields[name] = fields.get(name, 0) + int(line.split()[1]) * 1024
    print(json.dumps(fields), flush=True)
    sys.stdin.readline()
""")


def test_two_worker_processes_started_together_write_once_and_share_the_pages(tmp_path):
    """Real processes, as `disagg serve` starts them: one writes the file while the other waits for it, and then
    the file's pages each maps are shared (the page cache holds them once: each one's PSS is half its RSS)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    for entry in cache_dir().iterdir():  # the built kernels and tiny checkpoints, not the packed weights
        if entry.name != "packed-weights":
            (cache / entry.name).symlink_to(entry)
    script = WORKER.format(tests=os.path.dirname(__file__), model=tiny_model("llama"))
    env = {**os.environ, "DISAGG_CACHE": str(cache)}
    workers = [subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
               for _ in range(2)]
    try:
        loaded = [json.loads(w.stdout.readline()) for w in workers]
        assert sorted(report["note"].split(" the box")[0] for report in loaded) == ["mapped", "wrote"]
        assert [report["loose"] for report in loaded] == [[], []]
        for w in workers:
            w.stdin.write("measure\n")
            w.stdin.flush()
        measured = [json.loads(w.stdout.readline()) for w in workers]
        payload = shared_weights.read(next(cache.glob("packed-weights/*/weights.bin")), next(cache.glob("packed-weights/*")).name).nbytes
        for fields in measured:
            assert fields["Rss"] >= 0.9 * payload and fields["Shared_Clean"] >= 0.9 * fields["Rss"], (fields, payload)
            assert fields["Pss"] <= 0.6 * fields["Rss"], fields
        for w in workers:
            w.stdin.write("exit\n")
            w.stdin.flush()
        assert [w.wait(timeout=60) for w in workers] == [0, 0]
    finally:
        for w in workers:
            w.kill()
