"""`disagg bench --api openai` against a tiny OpenAI-style server written here:
it streams a fixed token sequence as completion chunks (server-sent events),
the way vLLM does, and the report must count exactly those tokens."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from disagg.cli.main import main

pytest.importorskip("httpx")

TOKENS = [101, 102, 103, 104, 105, 106, 107, 108]


class FakeCompletions(BaseHTTPRequestHandler):
    """/v1/models, /tokenize, and streaming /v1/completions; prompts of a
    negative id are refused with 400, as vLLM refuses ids outside the vocabulary."""

    with_token_ids = True
    seen: ClassVar[list[dict]] = []

    def log_message(self, *args):
        pass

    def reply_json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            self.reply_json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        else:
            self.reply_json(404, {"error": {"message": "not found"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":
            self.reply_json(200, {"tokens": [ord(c) for c in body["prompt"]][:50], "count": 50})
            return
        type(self).seen.append(body)
        if body["model"] != "fake-model" or min(body["prompt"]) < 0:
            self.reply_json(400, {"error": {"message": "bad request"}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        tokens = TOKENS[: body["max_tokens"]]
        for i, token in enumerate(tokens):
            choice = {"index": 0, "text": f" t{token}", "logprobs": None, "finish_reason": "length" if i == len(tokens) - 1 else None}
            if self.with_token_ids:
                choice["token_ids"] = [token]
            self.event({"id": "cmpl-1", "object": "text_completion", "model": "fake-model", "choices": [choice]})
        self.event({"id": "cmpl-1", "object": "text_completion", "choices": [], "usage": {"completion_tokens": len(tokens)}})
        self.wfile.write(b"data: [DONE]\n\n")

    def event(self, payload: dict) -> None:
        self.wfile.write(f"data: {json.dumps(payload)}\n\n".encode())
        self.wfile.flush()


@pytest.fixture
def fake_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeCompletions)
    FakeCompletions.seen = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    FakeCompletions.with_token_ids = True


@pytest.mark.parametrize("with_token_ids", [True, False])
def test_closed_loop_counts_the_streamed_tokens(fake_server, tmp_path, capsys, with_token_ids):
    FakeCompletions.with_token_ids = with_token_ids
    out = tmp_path / "openai.json"
    assert main(["bench", "--api", "openai", "--url", fake_server, "--concurrency", "3", "--requests", "7", "--warmup", "2",
                 "--prompt-len", "16", "--output-len", "6", "--json", str(out), "--no-progress"]) == 0
    run = json.loads(out.read_text())[0]
    assert run["mode"] == "closed" and run["concurrency"] == 3
    assert run["requests"] == run["ok"] == 7 and run["errors"] == {}
    assert run["output_tokens_per_second"] * run["seconds"] == pytest.approx(7 * 6)
    assert "7/7 ok" in capsys.readouterr().out
    sent = FakeCompletions.seen
    assert len(sent) == 9  # warm-up and measured
    for body in sent:
        assert body["stream"] is True and body["ignore_eos"] is True and body["temperature"] == 0.0 and body["max_tokens"] == 6
        assert len(body["prompt"]) == 16 and all(isinstance(t, int) for t in body["prompt"])


def test_token_ids_and_refusals_reach_the_load_generator(fake_server):
    import asyncio

    from disagg.clients.openai_client import OpenAIClient
    from disagg.tools.loadgen import RequestSpec, closed_loop, summarize

    class NoBar:
        def update(self, _):
            pass

    async def run():
        async with OpenAIClient(fake_server, timeout=30) as client:
            streamed = [chunk.token_ids async for chunk in client.generate([5, 6, 7], max_new_tokens=4)]
            specs = [RequestSpec([5, 6, 7], 5), RequestSpec([-1, 6], 5), RequestSpec([8], 3)]
            return streamed, await closed_loop(client, specs, 2, NoBar())

    streamed, results = asyncio.run(run())
    assert streamed == [[t] for t in TOKENS[:4]]
    summary = summarize(results, 1.0, 1e9, 1e9)
    assert summary["ok"] == 2 and summary["errors"] == {"HTTP_400": 1}
    assert sorted(r.output_tokens for r in results if r.ok) == [3, 5]
    assert sum(len(r.token_gaps) for r in results) == (3 - 1) + (5 - 1)


def test_an_unreachable_server_is_an_error_in_the_report(tmp_path):
    import asyncio

    from disagg.clients.openai_client import OpenAIClient
    from disagg.tools.loadgen import RequestSpec, run_one

    async def run():
        async with OpenAIClient("http://127.0.0.1:9", timeout=5, model="m") as client:
            return await run_one(client, RequestSpec([1, 2], 2))

    result = asyncio.run(run())
    assert not result.ok and result.code == "UNAVAILABLE"
