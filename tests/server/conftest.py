"""Real servers for the server tests: `hybridmoe serve` in a subprocess on a free 127.0.0.1 port,
over a tiny float32 Qwen3-MoE checkpoint made once per session (float32, so a request's greedy
tokens do not depend on what else is in its batch)."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import openai
import pytest

from hybridmoe.checkpoint.make import make_checkpoint
from hub_cache import directory_files, put

STARTUP_SECONDS = 120

PROBE = {"model": "tiny", "prompt": "A well-formed request", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
"""The greedy request that runs beside a hostile one: it must get the answer it gets alone."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, url: str, proc: subprocess.Popen, log_path, api_key: str | None):
        self.url, self.proc, self.log_path, self.api_key = url, proc, log_path, api_key
        self._solo: dict | None = None

    def client(self, api_key: str = "none", **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60, **kwargs)

    def get(self, path: str, headers: dict | None = None) -> tuple[int, bytes]:
        return self.request("GET", path, None, headers)

    def post(self, path: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, bytes]:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        return self.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})

    def request(self, method: str, path: str, data: bytes | None, headers: dict | None) -> tuple[int, bytes]:
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of /metrics, e.g. metric("requests_finished_total", 'finish_reason="abort"')."""
        _, text = self.get("/metrics")
        key = f"hybridmoe_{name}" + (f"{{{labels}}}" if labels else "")
        m = re.search(rf"^{re.escape(key)} (\S+)$", text.decode(), re.M)
        return float(m.group(1)) if m else 0.0

    def alongside(self, hostile):
        """hostile() while PROBE runs beside it; asserts that PROBE gets its solo answer. Returns hostile()."""
        if self._solo is None:
            self._solo = self._probe()
        with ThreadPoolExecutor(1) as pool:
            probe = pool.submit(self._probe)
            result = hostile()
            assert probe.result() == self._solo
        return result

    def _probe(self) -> dict:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        code, raw = self.post("/v1/completions", PROBE, headers)
        assert code == 200, raw
        choice = json.loads(raw)["choices"][0]
        return {"text": choice["text"], "finish_reason": choice["finish_reason"]}

    def wait_until(self, condition, timeout: float = 20.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.05)


@contextmanager
def _serve(model_dir, log_path, *args, api_key=None, name="tiny", env=None):
    """`hybridmoe serve` on a free port (served as `name`; None: the server's own choice), env: extra variables."""
    port = _free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridmoe.cli", "serve", "--model", str(model_dir), "--port", str(port),
         "--dtype", "float32", "--device", "cpu", *(["--served-model-name", name] if name else []),
         "--log-level", "warning", *args, *(["--api-key", api_key] if api_key else [])],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    server = Server(f"http://127.0.0.1:{port}", proc, log_path, api_key)
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}:\n{log_path.read_text()}")
            try:
                if server.get("/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not answer /health in {STARTUP_SECONDS} s")
            time.sleep(0.1)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="session")
def server(tiny_qwen3_fp32, tmp_path_factory):
    """The main server: no API key, batch 8."""
    with _serve(tiny_qwen3_fp32, tmp_path_factory.mktemp("logs") / "server.log", "--max-batch", "8") as s:
        yield s


@pytest.fixture(scope="session")
def small_server(tiny_qwen3_fp32, tmp_path_factory):
    """A server with an API key, one running request and one queued at most: for 401 and 429."""
    with _serve(tiny_qwen3_fp32, tmp_path_factory.mktemp("logs") / "small_server.log", "--max-batch", "1",
                "--max-queue", "1", api_key="test-key-123") as s:
        yield s


@pytest.fixture(scope="session")
def timeout_server(tiny_qwen3_fp32, tmp_path_factory):
    """A server with short deadlines: 3 s for a request's headers, 3 s for its body, 3 s of idle keep-alive."""
    with _serve(tiny_qwen3_fp32, tmp_path_factory.mktemp("logs") / "timeout_server.log", "--timeout-headers", "3",
                "--timeout-body", "3", "--timeout-keep-alive", "3") as s:
        yield s


@pytest.fixture(scope="session")
def slow_template_server(tiny_qwen3_fp32, tmp_path_factory):
    """A server whose chat template takes 990,000 loop steps (most of a second) on a conversation that opens
    with 'render slowly', and renders any other as the tiny model's own template does."""
    model_dir = tmp_path_factory.mktemp("slow_template") / "model"
    shutil.copytree(tiny_qwen3_fp32, model_dir)
    template = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    slow = "{%- for _ in range(990000) %}{{- '' }}{{- '' }}{%- endfor %}"
    (model_dir / "chat_template.jinja").write_text(
        f"{{%- if messages[0]['content'] == 'render slowly' %}}{slow}{{%- endif %}}{template}")
    with _serve(model_dir, tmp_path_factory.mktemp("logs") / "slow_template_server.log") as s:
        yield s


@pytest.fixture(scope="session")
def hub_server(tiny_qwen3_fp32, tmp_path_factory):
    """A server of --model org/tiny: the tiny checkpoint in a Hub cache the test lays out, offline."""
    cache = tmp_path_factory.mktemp("hub")
    put(cache, "org/tiny", directory_files(tiny_qwen3_fp32), "a" * 40)
    with _serve("org/tiny", tmp_path_factory.mktemp("logs") / "hub_server.log", name=None,
                env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}) as s:
        yield s


@pytest.fixture(scope="session")
def long_server(tmp_path_factory):
    """A server of the tiny Qwen3 model with a context of 4096 tokens (the preset's is 512): room for tools'
    descriptions in the prompt, which the tiny tokenizer spells out in many tokens."""
    model_dir = tmp_path_factory.mktemp("tiny_qwen3_long")
    make_checkpoint("qwen3_moe", "tiny", model_dir, dtype="fp32", progress=False,
                    overrides={"max_position_embeddings": 4096})
    with _serve(model_dir, tmp_path_factory.mktemp("logs") / "long_server.log", "--max-batch", "8") as s:
        s.model_dir = model_dir
        yield s


@pytest.fixture(scope="session", params=["deepseek_v3", "glm4_moe", "minimax_m2", "gpt_oss"])
def special_token_tools_server(request, tmp_path_factory):
    """A tiny model with a context of 4096 tokens whose chat template writes tool calls with special tokens:
    DeepSeek-V3's sections, GLM-4.5's per-argument tags, MiniMax-M2's <minimax:tool_call> sections, gpt-oss's
    harmony messages."""
    model_dir = tmp_path_factory.mktemp(f"tiny_{request.param}_long")
    make_checkpoint(request.param, "tiny", model_dir, dtype="fp32", progress=False,
                    overrides={"max_position_embeddings": 4096})
    with _serve(model_dir, tmp_path_factory.mktemp("logs") / f"{request.param}_server.log", "--max-batch", "4") as s:
        s.model_dir = model_dir
        yield s
