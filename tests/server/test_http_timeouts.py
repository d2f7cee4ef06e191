"""A client that sends its request slowly, or never finishes it, loses the connection: timeout_server gives
3 s for a request's headers (from connecting), 3 s for its body and 3 s of idle keep-alive. Past a deadline
the server answers 408 and closes. The waits below allow 60 s: they test what happens, not how fast."""

import socket
import threading
import time
from urllib.parse import urlparse

import pytest

WAIT = 60


def _connect(server) -> socket.socket:
    url = urlparse(server.url)
    return socket.create_connection((url.hostname, url.port), timeout=WAIT)


def _read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


@pytest.mark.parametrize("sent", [
    b"",  # connects and says nothing
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",  # headers begun, never ended
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
     b'{"model": "tiny", '),  # the body begun, never ended
], ids=["silent", "partial-headers", "partial-body"])
def test_an_unfinished_request_gets_408_and_the_connection_closes(timeout_server, sent):
    with _connect(timeout_server) as sock:
        sock.sendall(sent)
        answer = timeout_server.alongside(lambda: _read_to_close(sock))
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert answer.endswith(b'"code": "request_timeout"}}')


def test_a_trickling_client_is_cut_at_the_deadline(timeout_server):
    request = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 10_000
    with _connect(timeout_server) as sock:
        closed = threading.Event()

        def trickle():  # one byte every 0.1 s: never idle, never done
            for byte in request:
                if closed.is_set():
                    return
                try:
                    sock.send(bytes([byte]))
                except OSError:
                    return
                time.sleep(0.1)

        sender = threading.Thread(target=trickle)
        sender.start()
        try:
            answer = _read_to_close(sock)
        finally:
            closed.set()
            sender.join()
    assert answer.startswith(b"HTTP/1.1 408 ")


def test_an_idle_kept_alive_connection_closes(timeout_server):
    with _connect(timeout_server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = _read_to_close(sock)  # the answer, then nothing more: keep-alive ends the connection
    assert answer.startswith(b"HTTP/1.1 200 ") and b'"status":"ok"' in answer


def test_a_request_sent_at_once_is_served(timeout_server):
    r = timeout_server.client().completions.create(model="tiny", prompt="in time", max_tokens=4)
    assert r.choices[0].text is not None
