"""The API key and the queue limit, on a server with --api-key, --max-batch 1 and --max-queue 1."""

import http.client
import json
import socket
from urllib.parse import urlparse

import openai
import pytest

KEY = "test-key-123"  # small_server's --api-key
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize("method, path", [
    ("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
    ("POST", "/api/chat"), ("POST", "/api/generate"), ("GET", "/api/tags"),
])
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_api_routes_need_the_key(small_server, method, path, headers):
    code, raw = small_server.request(method, path, b"{}" if method == "POST" else None, headers)
    assert code == 401
    assert json.loads(raw)["error"]["code"] == "invalid_api_key"


def test_right_key_passes_and_open_routes_stay_open(small_server):
    assert small_server.get("/v1/models", AUTH)[0] == 200
    for path in ("/health", "/metrics", "/"):
        assert small_server.get(path)[0] == 200
    with pytest.raises(openai.AuthenticationError):
        small_server.client(api_key="wrong").models.list()
    r = small_server.client(api_key=KEY).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r.choices[0].message.content is not None


def _start_stream(server):
    url = urlparse(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    body = {"model": "tiny", "prompt": "long", "max_tokens": 480, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json", **AUTH})
    return conn


def _in_flight(server) -> int:
    return json.loads(server.get("/health")[1])["requests_in_flight"]


def test_full_queue_answers_429_with_retry_after(small_server):
    running = _start_stream(small_server)
    assert running.getresponse().readline().startswith(b"data: ")
    waiting = _start_stream(small_server)  # batch 1 is taken: this one waits in the queue
    small_server.wait_until(lambda: _in_flight(small_server) == 2, what="the second request to queue")
    try:
        code, raw = small_server.post("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2}, AUTH)
        assert code == 429
        assert json.loads(raw)["error"]["type"] == "rate_limit_error"
        with pytest.raises(openai.RateLimitError) as e:
            small_server.client(api_key=KEY).completions.create(model="tiny", prompt="x", max_tokens=2)
        assert e.value.response.headers["Retry-After"] == "1"
    finally:
        for conn in (running, waiting):
            conn.sock.shutdown(socket.SHUT_RDWR)
            conn.close()
    # both clients gone: both requests are dropped, and new ones get in again
    small_server.wait_until(lambda: _in_flight(small_server) == 0, what="the requests to be released")
    r = small_server.client(api_key=KEY).completions.create(model="tiny", prompt="x", max_tokens=2)
    assert r.usage.completion_tokens <= 2
