"""A client that goes away cancels its request at once: the slot is freed (requests_running drops
to 0) and the request leaves the engine as "abort", long before its max_tokens were reached."""

import http.client
import json
import socket
from urllib.parse import urlparse

import pytest

LONG = {"model": "tiny", "temperature": 0, "max_tokens": 480, "ignore_eos": True}


def _open(server, path, body):
    url = urlparse(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return conn


@pytest.mark.parametrize("path, body, stream", [
    ("/v1/completions", {**LONG, "prompt": "never read to the end", "stream": True}, True),
    ("/v1/chat/completions", {**LONG, "messages": [{"role": "user", "content": "bye"}], "stream": True}, True),
    ("/v1/completions", {**LONG, "prompt": "the client gives up waiting"}, False),
])
def test_disconnect_frees_the_slot(server, path, body, stream):
    aborted = server.metric("requests_finished_total", 'finish_reason="abort"')
    generated = server.metric("generation_tokens_total")
    conn = _open(server, path, body)
    if stream:
        response = conn.getresponse()
        assert response.status == 200
        assert response.readline().startswith(b"data: ")  # the stream is running
    else:
        server.wait_until(lambda: server.metric("requests_running") == 1, what="the request to start")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    server.wait_until(lambda: server.metric("requests_finished_total", 'finish_reason="abort"') == aborted + 1,
                      what="the request to be aborted")
    assert server.metric("requests_running") == 0
    assert server.metric("generation_tokens_total") - generated < 480
    # the server goes on answering
    r = server.client().completions.create(model="tiny", prompt="still here", max_tokens=4)
    assert r.choices[0].text is not None
