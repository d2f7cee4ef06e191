"""uvicorn's HTTP/1.1 protocol (h11) with deadlines on receiving a request.

uvicorn bounds only the idle time between two requests of a connection (timeout_keep_alive). Here a
client also has `header_timeout` seconds, from opening the connection or from the first byte of its next
request, to send the request line and headers, then `body_timeout` seconds to send the whole body. Past a
deadline the server answers 408 (when its answer has not begun) and closes the connection, so a client
that sends slowly, or never finishes, holds a connection for a bounded time. How long the answer itself
takes (a long generation) is not bounded here.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_TIMEOUT_BODY = json.dumps({"error": {"message": "the request was not received in time", "type":
                                      "invalid_request_error", "param": None, "code": "request_timeout"}}).encode()
_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                     b"content-length: " + str(len(_TIMEOUT_BODY)).encode() + b"\r\n\r\n" + _TIMEOUT_BODY)


class DeadlineH11Protocol(H11Protocol):
    header_timeout: float = 30.0
    """Seconds to receive a request's line and headers."""
    body_timeout: float = 60.0
    """Seconds to receive a request's body, from the end of its headers."""

    def connection_made(self, transport) -> None:
        self._phase: str | None = None  # "headers", "body" or None: what the deadline waits for
        self._deadline = None
        super().connection_made(transport)
        self._enter("headers")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        self._enter(None)
        super().on_response_complete()
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._enter(None)
        super().connection_lost(exc)

    def _follow(self) -> None:
        """The phase h11's view of the client says: its headers or its body still to come, or neither."""
        state = self.conn.their_state
        if self.transport.is_closing():
            self._enter(None)
        elif state is h11.SEND_BODY:
            self._enter("body")
        elif state is h11.IDLE and (self._phase == "headers" or self.conn.trailing_data[0]):
            self._enter("headers")  # a new connection, or the start of a request's headers
        else:
            self._enter(None)

    def _enter(self, phase: str | None) -> None:
        if phase == self._phase:
            return
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = phase
        if phase is not None:
            timeout = self.header_timeout if phase == "headers" else self.body_timeout
            self._deadline = self.loop.call_later(timeout, self._expire)

    def _expire(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # no answer begun: say why it ends
            self.transport.write(_TIMEOUT_RESPONSE)
        self.transport.close()


def deadline_protocol(header_timeout: float, body_timeout: float) -> type[DeadlineH11Protocol]:
    """The protocol class to hand uvicorn (its `http` option), with these deadlines."""
    return type("DeadlineH11Protocol", (DeadlineH11Protocol,),
                {"header_timeout": header_timeout, "body_timeout": body_timeout})
