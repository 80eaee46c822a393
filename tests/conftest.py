"""Shared fixtures: tiny trained checkpoints made on the fly, their transformers
references, and real local clusters (separate processes, real gRPC)."""

from __future__ import annotations

import functools
import pathlib

import pytest

from disagg.kv_transport import DEFAULT, TRANSPORTS, resolve
from disagg.tools.tinymodel import TinyModelSpec, cache_dir, checkpoint_path, ensure_tiny_model

ARCHITECTURES = ("llama", "qwen2", "mistral")
# What a worker started without --kv-transport uses here.
DEFAULT_TRANSPORT = resolve(DEFAULT)

# Test checkpoints by name: the plain ones by model type, plus sliding-window
# models whose 16-token window the tests' prompts run well past.
TEST_MODELS = {
    **{name: TinyModelSpec(architecture=name) for name in (*ARCHITECTURES, "gptj", "bloom")},
    "mistral-sw": TinyModelSpec(architecture="mistral", sliding_window=16),
    "gemma2-sw": TinyModelSpec(architecture="gemma2", sliding_window=16),  # sliding and full layers in turn
    "llama-held-out": TinyModelSpec(held_out_every=5),  # trained on all paragraphs but each fifth: held-out text to evaluate on
    # Trained on chats too, where it calls the tools it is offered (disagg/tools/tinymodel.py's TOOL_CHAT_*): tool_choice=auto end to end.
    "llama-tools": TinyModelSpec(training_text="tool-chat", train_steps=600),
    # Speculation's draft for the llama model: its tokenizer (the same vocabulary size and text), a quarter of its width, one layer.
    "llama-draft": TinyModelSpec(hidden_size=32, intermediate_size=96, num_layers=1, num_heads=2, num_kv_heads=1),
    # Heads 64 wide, as prefill_attention.c serves them (the others' are 16): a bf16 prompt's blocked attention (seeded weights).
    "llama-head64": TinyModelSpec(hidden_size=128, intermediate_size=256, num_heads=2, num_kv_heads=1, train_steps=0),
    # A draft that cannot serve the llama model: another tokenizer (untrained: only its vocabulary is read).
    "other-tokenizer": TinyModelSpec(vocab_size=600, hidden_size=32, intermediate_size=96, num_layers=1, num_heads=2, num_kv_heads=1, train_steps=0),
}


@functools.cache
def tiny_model(name: str = "llama") -> str:
    # Made once per machine (cached under DISAGG_CACHE); about ten seconds each.
    return str(ensure_tiny_model(TEST_MODELS[name], root=checkpoints_root()))


def checkpoints_root() -> pathlib.Path:
    return cache_dir() / "test-models"


# On a machine that has none of them yet (CI), a second process trains the test
# checkpoints while the first tests run, on the core they leave idle. In the order
# the suite first needs them, after llama, which the first test trains itself;
# a test that needs one being trained waits for it (ensure_tiny_model's lock).
BACKGROUND_ORDER = ("mistral-sw", "gemma2-sw", "gptj", "bloom", "qwen2", "mistral", "llama-held-out", "llama-tools", "llama", "llama-draft")
# Speculation's EAGLE heads (disagg/tools/tiny_eagle.py), trained after the models they read.
EAGLE_HEADS = ("llama", "qwen2", "mistral-sw")
EAGLE_STEPS = 200
_builder = None


@functools.cache
def eagle_head(name: str = "llama") -> str:
    """An EAGLE head trained for the tiny model on its text, cached as the models are."""
    from disagg.tools.tiny_eagle import ensure_eagle_head

    return str(ensure_eagle_head(tiny_model(name), EAGLE_STEPS, root=checkpoints_root()))


def pytest_sessionstart(session) -> None:
    global _builder
    import os
    import subprocess
    import sys

    missing = [name for name in BACKGROUND_ORDER if not checkpoint_path(TEST_MODELS[name], checkpoints_root()).exists()]
    if len(missing) > 1:  # one alone, the test that needs it trains as fast
        # One torch thread: on the core the tests leave idle; beside their processes a second OpenMP thread
        # made each training step 1.7x slower here.
        script = (f"import sys; sys.path.insert(0, {str(pathlib.Path(__file__).parent)!r}); import torch; torch.set_num_threads(1); "
                  f"import conftest; [conftest.tiny_model(n) for n in {missing!r}]; [conftest.eagle_head(n) for n in conftest.EAGLE_HEADS]")
        quiet = subprocess.DEVNULL  # a checkpoint it fails to make, the test that needs it makes, and says why
        _builder = subprocess.Popen([sys.executable, "-c", script], stdout=quiet, stderr=quiet, preexec_fn=lambda: os.nice(5))


def pytest_sessionfinish(session) -> None:
    if _builder is not None and _builder.poll() is None:
        _builder.kill()  # a checkpoint only half made is never used: it is saved under another name first
        _builder.wait()


class Reference:
    """transformers generate() on the same weights, float32: the ground truth."""

    def __init__(self, path: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.eos = self.tokenizer.eos_token_id

    def ids(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt)["input_ids"]

    @functools.cache
    def _greedy(self, prompt_ids: tuple[int, ...], max_new_tokens: int, ignore_eos: bool) -> tuple[int, ...]:
        extra = {"eos_token_id": None} if ignore_eos else {}
        # One torch thread: a tiny model's products gain nothing from more, and beside a running cluster's
        # workers a second OpenMP thread made each generate() several times slower (as the soak's reference).
        threads = self.torch.get_num_threads()
        self.torch.set_num_threads(1)
        try:
            with self.torch.no_grad():
                out = self.model.generate(self.torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=self.eos, **extra)
        finally:
            self.torch.set_num_threads(threads)
        return tuple(out[0, len(prompt_ids) :].tolist())

    def greedy(self, prompt: str | list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
        ids = self.ids(prompt) if isinstance(prompt, str) else prompt
        return list(self._greedy(tuple(ids), max_new_tokens, ignore_eos))


@functools.cache
def reference(architecture: str = "llama") -> Reference:
    return Reference(tiny_model(architecture))


@pytest.fixture(scope="session")
def llama_path() -> str:
    return tiny_model("llama")


@pytest.fixture(scope="session")
def llama_ref() -> Reference:
    return reference("llama")


def start_cluster(tmp_root: pathlib.Path, architecture: str, prefill: int = 1, decode: int = 1, transport: str | None = None, compile: bool = False,
                  model: str | None = None, **spec):
    """A router and its workers as processes; transport: --kv-transport on every worker (None: the default);
    model: a checkpoint of the architecture's other than its tiny model.

    compile: the decode workers compile their step (their default on CUDA). The
    shared llama cluster (exactness, concurrency, every API test) runs compiled on
    CPU too; the rest eager, to keep CI short (each model's compile costs about a
    minute here; tests/test_compiled.py compiles each architecture in process).

    Each worker runs one torch thread unless the test asks otherwise (threads_per_worker):
    the launcher's default splits the machine's cores, and the float32 C kernels run only
    on one thread, so without it a 64-core host would run other code than a 2-core one."""
    from disagg.tools.local_cluster import ClusterSpec, LocalCluster

    spec.setdefault("threads_per_worker", 1)
    # Forked from one process that imported torch and transformers (disagg/tools/forked_launch.py): a cluster starts in
    # about 2.7 s here instead of 7.5, over a hundred clusters a run. Each part is still a process of its own.
    spec.setdefault("forked", True)

    name = f"{architecture}-{prefill}p{decode}d" + (f"-{transport}" if transport else "")
    if transport:
        spec["worker_args"] = [*spec.get("worker_args", ()), "--kv-transport", transport]
    cluster = LocalCluster(ClusterSpec(
        model=model or tiny_model(architecture), prefill_workers=prefill, decode_workers=decode, dtype="float32", log_dir=str(tmp_root / name),
        compile=compile, **spec
    ))
    try:
        return cluster.start(timeout=600.0 if compile else 180.0)  # compiling takes minutes on a loaded CI machine
    except Exception:
        cluster.stop()
        for log in sorted((tmp_root / name).glob("*.log")):
            print(f"--- {log.name}\n{log.read_text()[-3000:]}")
        raise


@pytest.fixture
def one_torch_thread():
    """This process on one torch thread for the test (the workers' default here, and what the C kernels serve)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def cluster_logs(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("clusters")


@pytest.fixture(scope="session")
def llama_cluster(cluster_logs):
    # It serves the OpenAI-compatible HTTP API too (cluster.http_url), for tests/test_http_api.py.
    cluster = start_cluster(cluster_logs, "llama", http_port=0, compile=True)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module", params=TRANSPORTS)
def transport(request) -> str:
    """Each KV transport in turn, for the modules that run end to end over both."""
    if request.param == "nixl" and resolve("auto") != "nixl":
        pytest.skip("NIXL is not installed (pip install nixl-cu12; the test extra has it)")
    return request.param


@pytest.fixture(scope="module")
def lone_decode_worker(cluster_logs):
    """One decode worker process alone (no router), with a 1 s lease, for the internal API."""
    from disagg.tools.local_cluster import ClusterSpec, LocalCluster

    cluster = LocalCluster(ClusterSpec(
        model=tiny_model("llama"), dtype="float32", compile=False, threads_per_worker=1, log_dir=str(cluster_logs / "lone-decode"),
    ))
    worker = cluster.add_worker("decode", ["--lease-seconds", "1", "--batch-size", "2"])
    try:
        cluster.wait_serving(120, worker.address)
        yield worker.address
    finally:
        cluster.stop()


def assert_nothing_held(cluster, within: float = 2.0) -> None:
    """Every live worker holds no slot, reservation, running row, transfer or queued prefill."""
    held = cluster.wait_until_idle(within)
    assert held and all(v == [0, 0, 0, 0, 0] for v in held.values()), held


def kv_bytes_received(cluster, transport: str) -> float:
    """KV bytes the cluster's decode workers took in through `transport`, from their metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for process in cluster.processes:
        if not process.name.startswith("decode"):
            continue
        text = urllib.request.urlopen(f"http://{process.metrics_address}/metrics", timeout=5).read().decode()
        for family in text_string_to_metric_families(text):
            total += sum(s.value for s in family.samples if s.name == "disagg_decode_kv_received_bytes_total" and s.labels.get("transport") == transport)
    return total


class PresenceFrequencyPenalty:
    """OpenAI's presence and frequency penalties as a transformers logits processor,
    over the tokens generated after the prompt: the reference the engine must match."""

    def __init__(self, prompt_len: int, presence: float, frequency: float):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        import torch

        generated = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)
