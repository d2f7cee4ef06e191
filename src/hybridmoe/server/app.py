"""The HTTP app: routes, API-key check, errors in OpenAI's JSON, HTTP metrics.

Routes: /v1/chat/completions, /v1/completions, /v1/models (OpenAI); /v1/messages, /v1/messages/count_tokens
(Anthropic, answering errors in Anthropic's JSON); /api/chat, /api/generate, /api/tags, /api/version (Ollama);
/health, /metrics (Prometheus text); / (the web chat page, with a banner when the model's weights are random:
a make-model checkpoint, whose text is noise).
With an API key, every /v1 and /api route wants `Authorization: Bearer KEY`; the Anthropic routes also take
`x-api-key: KEY` (what Anthropic's clients send) and answer a missing or wrong key in Anthropic's JSON.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from importlib import resources

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response

from hybridmoe.errors import HybridMoEError
from hybridmoe.server import anthropic_api, ollama
from hybridmoe.server.async_engine import AsyncEngine, EngineError, QueueFullError
from hybridmoe.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from hybridmoe.server.serving_chat import create_chat_completion
from hybridmoe.server.serving_common import (
    APIError,
    ClientGoneError,
    ServerState,
    parse_body,
)
from hybridmoe.server.serving_completion import create_completion

log = logging.getLogger("hybridmoe.server")

RANDOM_WEIGHTS_BANNER = ('<p id="random-weights" class="banner">This model\'s weights are random (a '
                         '<code>hybridmoe make-model</code> checkpoint): the text it writes is noise.</p>')
"""What the web page shows, in place of its <!--random-weights--> mark, when the weights are random."""

RETRY_AFTER_SECONDS = 1
CLIENT_CLOSED_REQUEST = 499  # nginx's code for a client gone before the answer; never seen by it


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None) -> FastAPI:
    """The app over a started-or-not AsyncEngine; the app's lifespan starts and stops it."""
    state = ServerState(engine=engine, model_name=model_name, created=int(time.time()), api_key=api_key)

    @asynccontextmanager
    async def lifespan(_app):
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()
            state.close()

    app = FastAPI(title="hybridmoe", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state

    @app.exception_handler(APIError)
    async def _api_error(_request, e: APIError):
        return e.response()

    @app.exception_handler(QueueFullError)
    async def _queue_full(_request, e: QueueFullError):
        return APIError(429, str(e), type_="rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)}).response()

    @app.exception_handler(HybridMoEError)
    async def _user_error(_request, e: HybridMoEError):
        return APIError(400, str(e)).response()

    @app.exception_handler(EngineError)
    async def _engine_error(_request, e: EngineError):
        return APIError(500, str(e), type_="server_error").response()

    @app.exception_handler(ClientGoneError)
    async def _client_gone(_request, _e):
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(Exception)
    async def _bug(_request, e: Exception):
        log.exception("request failed")
        return APIError(500, f"the server failed: {type(e).__name__}: {e}", type_="server_error").response()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await create_chat_completion(state, await parse_body(request, ChatCompletionRequest), request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await create_completion(state, await parse_body(request, CompletionRequest), request)

    @app.get("/v1/models")
    async def models():
        card = ModelCard(id=model_name, created=state.created, max_model_len=state.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump(mode="json"))

    @app.post("/v1/messages")
    async def anthropic_messages(request: Request):
        return await anthropic_api.create_message(state, request)

    @app.post("/v1/messages/count_tokens")
    async def anthropic_count_tokens(request: Request):
        return await anthropic_api.count_tokens(state, request)

    @app.post("/api/chat")
    async def ollama_chat(request: Request):
        return await ollama.chat(state, await parse_body(request, ollama.OllamaChatRequest), request)

    @app.post("/api/generate")
    async def ollama_generate(request: Request):
        return await ollama.generate(state, await parse_body(request, ollama.OllamaGenerateRequest), request)

    @app.get("/api/tags")
    async def ollama_tags():
        return ollama.tags(state)

    @app.get("/api/version")
    async def ollama_version():
        return ollama.version()

    random_weights = engine.engine.random_weights

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "requests_in_flight": engine.num_in_flight,
                "random_weights": random_weights}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine.metrics.render(), media_type="text/plain; version=0.0.4")

    page = index_page(random_weights)

    @app.get("/")
    async def index():
        return HTMLResponse(page)

    return AuthAndMetrics(app, api_key, engine.metrics, {r.path for r in app.routes})


def index_page(random_weights: bool) -> str:
    """The web chat page (static/index.html), with RANDOM_WEIGHTS_BANNER when the weights are random."""
    page = resources.files("hybridmoe.server").joinpath("static/index.html").read_text(encoding="utf-8")
    return page.replace("<!--random-weights-->", RANDOM_WEIGHTS_BANNER if random_weights else "")


class AuthAndMetrics:
    """ASGI wrapper: the API-key check on /v1 and /api, and a count of answers by route and status.

    Plain ASGI rather than a BaseHTTPMiddleware, which would wrap streaming responses and hide
    the client's disconnect from them."""

    def __init__(self, app: FastAPI, api_key: str | None, metrics, routes: set[str]):
        self.app, self.api_key, self.metrics, self.routes = app, api_key, metrics, routes
        self.state = app.state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = path if path in self.routes else "other"
        status = {"code": 0}

        async def send_and_count(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        anthropic = path == anthropic_api.ANTHROPIC_PATH or path.startswith(anthropic_api.ANTHROPIC_PATH + "/")
        try:
            if self.api_key and path.startswith(("/v1/", "/api/")) and not self._authorized(scope, anthropic):
                await _send_json(send_and_count, 401, _unauthorized_body(anthropic), {"WWW-Authenticate": "Bearer"})
            else:
                await self.app(scope, receive, send_and_count)
        finally:
            self.metrics.http_requests.inc(route, status["code"] or CLIENT_CLOSED_REQUEST)

    def _authorized(self, scope, anthropic: bool) -> bool:
        """Whether the request carries the key: as its bearer token, or (anthropic) as its x-api-key header."""
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer" and self._is_key(token.strip()):
                    return True
            elif anthropic and name == b"x-api-key" and self._is_key(value.decode("latin-1").strip()):
                return True
        return False

    def _is_key(self, token: str) -> bool:
        return hmac.compare_digest(token.encode(), self.api_key.encode())


def _unauthorized_body(anthropic: bool) -> dict:
    """The 401's JSON: Anthropic's error shape on its routes, OpenAI's elsewhere."""
    if anthropic:
        return anthropic_api.error_body(APIError(
            401, "a valid API key is required: send the header 'x-api-key: <key>' or 'Authorization: Bearer <key>'"))[1]
    return APIError(401, "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                    code="invalid_api_key").body()


async def _send_json(send, status: int, body: dict, headers: dict[str, str]) -> None:
    data = json.dumps(body).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": data})
