"""The HTTP edge's bounds, through a real router process: a body over the limit
(declared or chunked) gets 413 in OpenAI's shape before it is read, without
growing the router's memory; messages, model, user and a prompt batch times n
over the queue are refused naming the field; a huge prompt's tokenization does
not hold small requests; a request past its deadline gets 504; and the router
still answers transformers' greedy tokens afterwards, holding nothing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import assert_nothing_held, start_cluster

LIMIT = 4 * 1024 * 1024  # the default --http-max-body-bytes
MAX_QUEUE = 8
TIMEOUT_SECONDS = 20  # the cluster's --http-timeout-seconds
PROMPT = "The lighthouse keeper"


@pytest.fixture(scope="module")
def gate(tmp_path_factory) -> pathlib.Path:
    """DISAGG_TEST_LONG_TOKENIZE_GATE: long tokenizations pass while this file exists."""
    path = tmp_path_factory.mktemp("gate") / "open"
    path.touch()
    return path


@pytest.fixture(scope="module")
def cluster(cluster_logs, gate):
    os.environ["DISAGG_TEST_LONG_TOKENIZE_GATE"] = str(gate)
    try:
        args = ["--max-queue", str(MAX_QUEUE), "--http-timeout-seconds", str(TIMEOUT_SECONDS)]
        cluster = start_cluster(cluster_logs, "llama", http_port=0, router_args=args)
    finally:
        del os.environ["DISAGG_TEST_LONG_TOKENIZE_GATE"]
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def client(cluster):
    with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def router_rss_mb(cluster) -> float:
    status = pathlib.Path(f"/proc/{cluster.process('router').popen.pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]) / 1024


def host_port(cluster) -> tuple[str, int]:
    address = httpx.URL(cluster.http_url)
    return address.host, address.port


def read_response(sock: socket.socket) -> tuple[int, dict, dict]:
    """status, headers and JSON body of one HTTP/1.1 response with a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        piece = sock.recv(65536)
        assert piece, f"connection closed before a response: {data!r}"
        data += piece
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(headers["content-length"]):
        piece = sock.recv(65536)
        assert piece, "connection closed mid-response"
        body += piece
    return int(lines[0].split()[1]), headers, json.loads(body)


def assert_too_large(status: int, headers: dict, body: dict) -> None:
    assert status == 413, body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "request_too_large"
    assert str(LIMIT) in body["error"]["message"] and headers["connection"] == "close"


def assert_greedy(client, llama_ref) -> None:
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == llama_ref.greedy(PROMPT, 8, ignore_eos=True)


def test_a_declared_length_over_the_limit_is_refused_before_the_body_is_sent(cluster):
    before = router_rss_mb(cluster)
    with socket.create_connection(host_port(cluster), timeout=60) as sock:  # no token, no body: the header alone is enough
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {100 << 20}\r\n\r\n".encode())
        assert_too_large(*read_response(sock))
    assert router_rss_mb(cluster) - before < 200


def _send_chunked(sock: socket.socket, total: int, sent: list[int]) -> None:
    chunk = b"[" + b"1," * (32 * 1024)
    try:
        while sent[0] < total:
            sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            sent[0] += len(chunk)
    except OSError:  # the router closed the connection after its 413: the rest is never read
        pass


def test_a_chunked_body_is_cut_off_once_it_passes_the_limit_and_memory_stays_bounded(cluster):
    before = router_rss_mb(cluster)
    total, sent = 100 << 20, [0]
    with socket.create_connection(host_port(cluster), timeout=60) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
        sender = threading.Thread(target=_send_chunked, args=(sock, total, sent), daemon=True)
        sender.start()
        assert_too_large(*read_response(sock))
        with contextlib.suppress(OSError):  # already reset by the router's close
            sock.shutdown(socket.SHUT_RDWR)
        sender.join(60)
    assert not sender.is_alive() and sent[0] < total  # the router stopped reading: the 100 MiB were never all sent
    assert router_rss_mb(cluster) - before < 200


def test_a_body_under_the_limit_is_still_parsed_and_judged_on_its_fields(cluster):
    response = httpx.post(f"{cluster.http_url}/v1/completions", json={"prompt": "hi", "user": "u" * (LIMIT - 1024)}, timeout=120)
    assert response.status_code == 400 and response.json()["error"]["param"] == "user", response.text


async def _chunks(count: int):
    for _ in range(count):
        yield b"x" * 512


def test_the_limit_holds_with_or_without_a_token_and_follows_the_flag():
    from router.http.app import FrontState
    from router.http.server import HttpFront

    async def statuses() -> list[int]:
        state = FrontState(router=lambda: None, draining=lambda: False, auth_token="secret", model_path="m", max_body_bytes=2048)
        front = HttpFront(state, "127.0.0.1", 0)
        await front.start()
        url, token = f"http://127.0.0.1:{front.port}/v1/completions", {"authorization": "Bearer secret"}
        try:
            async with httpx.AsyncClient(timeout=30) as http:
                return [
                    (await http.post(url, content=b"x" * 3000)).status_code,  # declared, no token
                    (await http.post(url, content=b"x" * 3000, headers=token)).status_code,  # declared, the token
                    (await http.post(url, content=_chunks(6), headers=token)).status_code,  # chunked, 3072 bytes
                    (await http.post(url, content=b"x" * 2048)).status_code,  # at the limit: reaches the token check
                    (await http.post(url, content=_chunks(4), headers=token)).status_code,  # and the JSON parser
                ]
        finally:
            await front.stop()

    assert asyncio.run(statuses()) == [413, 413, 413, 401, 400]


def test_a_body_that_never_arrives_in_full_gets_408_at_the_deadline():
    from router.http.app import FrontState
    from router.http.server import HttpFront

    async def response() -> bytes:
        state = FrontState(router=lambda: None, draining=lambda: False, auth_token=None, model_path="m", timeout_seconds=1.0)
        front = HttpFront(state, "127.0.0.1", 0)
        await front.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{\"prompt\"")  # and nothing more
            answer = await asyncio.wait_for(reader.read(), 60)  # read() to EOF: the router closes the connection
            writer.close()
            return answer
        finally:
            await front.stop()

    answer = asyncio.run(response())
    assert answer.startswith(b"HTTP/1.1 408") and b'"code":"request_timeout"' in answer, answer


def test_a_head_that_never_arrives_in_full_is_cut_off_at_the_deadline_and_others_are_answered():
    """A connection sending its request line and headers a byte at a time, or nothing at all, is
    closed at the deadline (the whole request's here, 1 s, being under 30 s); a normal request on
    another connection meanwhile is answered."""
    from router.http.app import FrontState
    from router.http.server import HttpFront

    async def run() -> tuple[bytes, bytes, bytes]:
        state = FrontState(router=lambda: None, draining=lambda: False, auth_token=None, model_path="m", timeout_seconds=1.0)
        front = HttpFront(state, "127.0.0.1", 0)
        await front.start()
        try:
            silent_reader, silent = await asyncio.open_connection("127.0.0.1", front.port)  # sends nothing
            slow_reader, slow = await asyncio.open_connection("127.0.0.1", front.port)
            slow.write(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n")  # and never the blank line

            async def polite() -> bytes:
                reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
                writer.write(b"GET /v1/models HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                answer = await asyncio.wait_for(reader.read(), 30)
                writer.close()
                return answer

            answered = await polite()
            cut = [await asyncio.wait_for(r.read(), 30) for r in (silent_reader, slow_reader)]  # read() to EOF: the server closed
            silent.close()
            slow.close()
            return answered, cut[0], cut[1]
        finally:
            await front.stop()

    answered, silent, slow = asyncio.run(run())
    assert not answered.startswith(b"HTTP/1.1 408"), answered  # answered, whatever the route says without workers
    assert answered.startswith(b"HTTP/1.1 ") and silent == b"" and slow == b""  # closed unanswered (without the deadline, read() waits for ever)


def _refusal(cluster, path: str, body: dict) -> dict:
    response = httpx.post(f"{cluster.http_url}{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    return response.json()["error"]


def test_messages_model_and_user_are_bounded_naming_the_field(cluster):
    user = {"role": "user", "content": "hi"}
    cases = [
        ({"messages": [user] * 513}, "messages", "at most 512"),
        ({"messages": [{"role": "user", "content": "x" * ((1 << 20) + 1)}]}, "messages[0].content", "at most 1048576"),
        ({"messages": [user, {"role": "user", "content": [{"type": "text", "text": "x"}] * 65}]}, "messages[1].content", "at most 64"),
        ({"messages": [user], "model": "m" * 1025}, "model", "at most 1024"),
        ({"messages": [user], "user": "u" * 257}, "user", "at most 256"),
    ]
    for body, param, says in cases:
        error = _refusal(cluster, "/v1/chat/completions", body)
        assert error["param"] == param and says in error["message"] and error["type"] == "invalid_request_error", (param, error)
    assert _refusal(cluster, "/tokenize", {"prompt": "x", "model": "m" * 1025})["param"] == "model"


def test_lone_surrogates_are_refused_naming_the_field_not_an_internal_error(cluster):
    cases = [
        ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
        ("/v1/completions", {"prompt": "ok", "stop": ["\udfff"]}, "stop[0]"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, "messages[0].content[0].text"),
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ]
    for path, body, param in cases:  # json.dumps escapes them (\\ud800), as a client's JSON would
        response = httpx.post(f"{cluster.http_url}{path}", content=json.dumps(body), headers={"content-type": "application/json"}, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, (path, response.text)
        assert "lone surrogate" in response.json()["error"]["message"]


def test_a_prompt_batch_times_n_over_the_queue_is_refused_naming_the_field(cluster, client, model):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, prompt=["a", "b", "c"], n=3, max_tokens=1)
    assert refused.value.param == "n" and f"at most {MAX_QUEUE}" in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, prompt=["a"] * (MAX_QUEUE + 1), max_tokens=1)
    assert refused.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], n=MAX_QUEUE + 1, max_tokens=1)
    assert refused.value.param == "n"
    assert_nothing_held(cluster)


def _wait_for(condition, what: str, within: float = 60.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {within}s"
        time.sleep(0.02)


def _closed_gate(gate: pathlib.Path) -> pathlib.Path:
    entered = gate.with_name(gate.name + ".entered")
    entered.unlink(missing_ok=True)
    gate.unlink()
    return entered


def test_a_huge_prompt_being_tokenized_does_not_hold_small_requests(cluster, client, gate, llama_ref):
    entered = _closed_gate(gate)
    huge = "word " * ((1 << 20) // 5)  # a million characters: 16 times LONG_TEXT_CHARS
    url = cluster.http_url
    try:
        with ThreadPoolExecutor(2) as threads:
            tokenized = threads.submit(httpx.post, f"{url}/tokenize", json={"prompt": huge}, timeout=120)
            completed = threads.submit(httpx.post, f"{url}/v1/completions", json={"prompt": huge, "max_tokens": None}, timeout=120)
            _wait_for(entered.exists, "a long tokenization")
            assert_greedy(client, llama_ref)  # while a 3 MiB text holds the long-text thread
            assert httpx.post(f"{url}/tokenize", json={"prompt": PROMPT}).json()["tokens"] == llama_ref.ids(PROMPT)
            assert not tokenized.done() and not completed.done()
            gate.touch()
            assert tokenized.result().status_code == 200 and tokenized.result().json()["count"] > len(huge) // 10
            assert completed.result().status_code == 400 and completed.result().json()["error"]["param"] == "prompt"
    finally:
        gate.touch()
    assert_nothing_held(cluster)


def test_a_request_not_answered_by_its_deadline_gets_504(cluster, client, gate, llama_ref):
    entered = _closed_gate(gate)
    try:
        response = httpx.post(f"{cluster.http_url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "word " * 20000}]}, timeout=120)
        assert entered.exists()  # it was held in tokenization, not refused before
    finally:
        gate.touch()
    assert response.status_code == 504, response.text
    error = response.json()["error"]
    assert error["type"] == "timeout_error" and error["code"] == "deadline_exceeded" and f"{TIMEOUT_SECONDS} s" in error["message"]
    assert_greedy(client, llama_ref)
    assert_nothing_held(cluster)


def test_the_router_still_serves_greedy_tokens_after_every_refusal(cluster, client, llama_ref):
    assert_greedy(client, llama_ref)
    assert cluster.process("router").popen.poll() is None
    assert_nothing_held(cluster)


def test_the_flags_default_to_the_grpc_message_limit_and_refuse_nonsense(llama_path):
    from router.__main__ import parse_config

    # --model named: without it the router would train the built-in default model (half a minute in a fresh clone)
    pool = ["--model", llama_path, "--prefill", "a:1", "--decode", "b:2"]
    config = parse_config(pool)
    assert config.http_max_body_bytes == LIMIT and config.http_timeout_seconds == 600
    assert parse_config([*pool, "--http-max-body-bytes", "65536"]).http_max_body_bytes == 65536
    with pytest.raises(SystemExit):
        parse_config([*pool, "--http-timeout-seconds", "0"])


def test_a_large_body_is_parsed_off_the_event_loop_while_small_requests_are_answered(monkeypatch):
    from router.http import bodies
    from router.http.app import FrontState
    from router.http.server import HttpFront

    entered, release, parsed_on = threading.Event(), threading.Event(), []
    parse = bodies.parse_large

    def held_parse(body: bytes):  # the large body's parse, held until the small requests are answered
        parsed_on.append(threading.current_thread())
        entered.set()
        assert release.wait(60), "the test never let the parse go"
        return parse(body)

    monkeypatch.setattr(bodies, "parse_large", held_parse)
    large = {"prompt": "hi", "user": "u" * (bodies.OFF_LOOP_BYTES + 1)}  # judged on its fields once parsed: 400 naming user
    small = {"prompt": "hi", "user": "u" * 300}

    async def run() -> tuple[threading.Thread, list[int], dict]:
        state = FrontState(router=lambda: None, draining=lambda: False, auth_token=None, model_path="m")
        front = HttpFront(state, "127.0.0.1", 0)
        await front.start()
        url = f"http://127.0.0.1:{front.port}/v1/completions"
        try:
            async with httpx.AsyncClient(timeout=60) as http:
                held = asyncio.create_task(http.post(url, json=large))
                assert await asyncio.to_thread(entered.wait, 60), "the large body never reached its parser"
                answered = [(await http.post(url, json=small)).status_code for _ in range(3)]  # while the parse is held
                answered.append((await http.post(url, content=b"{not json")).status_code)
                assert not held.done()
                release.set()
                return threading.current_thread(), answered, (await held).json()
        finally:
            release.set()
            await front.stop()

    loop_thread, answered, large_answer = asyncio.run(run())
    assert answered == [400, 400, 400, 400]  # small bodies parsed (on the loop) and judged while the large one waits
    assert large_answer["error"]["param"] == "user", large_answer
    assert len(parsed_on) == 1 and parsed_on[0] is not loop_thread  # only the large body went to the thread


def test_the_off_loop_parser_reads_json_as_the_c_parser_does():
    from router.http.bodies import parse_large

    body = json.dumps({"prompt": [[1, 2], "é\\ud83d\\ude00", {"a": None}], "n": 1.5e3, "t": True, "x": -0.0}).encode()
    assert parse_large(body) == json.loads(body)
    for bad in (b"{not json", b'{"a": 1,}', b"[" * 5 + b"]" * 4):
        with pytest.raises(json.JSONDecodeError):
            json.loads(bad)
        with pytest.raises(json.JSONDecodeError):
            parse_large(bad)
