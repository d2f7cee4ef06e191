"""`hybridmoe chat` in a pseudo-terminal, as a user types into it: line editing and history (prompt_toolkit), the
reply, and the line of tokens and speed after it. Every wait is bounded; the bounds are far above what the tiny
model needs on a loaded machine."""

import fcntl
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time

import pytest

from hybridmoe import LLM, SamplingParams

UP = b"\x1b[A"
PROMPT = b">>>"
STATS = re.compile(rb"\[4 tokens, length; first token \d+ ms, [\d.]+ tok/s after\]")
WAIT_S = 180


class Terminal:
    """A command on the slave side of a pty (80x24, xterm); read_until() collects its output."""

    def __init__(self, argv: list[str], env: dict):
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
        os.close(slave)
        self.output = b""

    def read_until(self, done) -> bytes:
        deadline = time.monotonic() + WAIT_S
        while not done(self.output):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out; the terminal shows:\n{self.output.decode(errors='replace')}")
            if select.select([self.master], [], [], 0.5)[0]:
                try:
                    self.output += os.read(self.master, 65536)
                except OSError:  # the command ended and closed the pty
                    break
        return self.output

    def wait_for_prompt(self, n: int) -> None:
        self.read_until(lambda out: out.count(PROMPT) >= n)

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def close(self) -> int:
        self.type(b"\x04")  # Ctrl-D at the prompt ends the session
        self.read_until(lambda out: self.proc.poll() is not None)
        rc = self.proc.wait(timeout=WAIT_S)
        os.close(self.master)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def chat(tiny_qwen3_fp32, tmp_path):
    started = []
    env = dict(os.environ, TERM="xterm", XDG_CACHE_HOME=str(tmp_path / "cache"), PROMPT_TOOLKIT_NO_CPR="1",
               COLUMNS="80", LINES="24")

    def start(*flags: str) -> Terminal:
        argv = [sys.executable, "-m", "hybridmoe.cli", "chat", "--model", str(tiny_qwen3_fp32), "--max-new-tokens",
                "4", "--temperature", "0", "--ignore-eos", *flags]
        started.append(Terminal(argv, env))
        return started[-1]

    yield start
    for term in started:
        term.kill()


def reply_text(model, *turns: str) -> str:
    """The greedy 4-token reply to the last of turns, each earlier turn answered the same way."""
    llm, history, params = LLM(model), [], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    for turn in turns:
        history.append({"role": "user", "content": turn})
        history.append({"role": "assistant", "content": llm.chat(history, params)[0].text})
    return history[-1]["content"]


def test_a_turn_shows_the_reply_then_its_stats_and_the_up_arrow_recalls_the_line(chat, tiny_qwen3_fp32, tmp_path):
    term = chat()
    term.wait_for_prompt(1)
    term.type(b"Hello there\r")
    out = term.read_until(lambda out: STATS.search(out) is not None)
    first_reply = reply_text(tiny_qwen3_fp32, "Hello there").replace("\n", "\r\n").encode()
    assert first_reply in out[out.rindex(b"Hello there"):STATS.search(out).start()]
    term.wait_for_prompt(2)
    shown = term.output.count(b"Hello there")
    term.type(UP)
    term.read_until(lambda out: out.count(b"Hello there") > shown)  # the line recalled
    term.type(b"\r")
    out = term.read_until(lambda out: len(STATS.findall(out)) >= 2)
    second_reply = reply_text(tiny_qwen3_fp32, "Hello there", "Hello there").replace("\n", "\r\n").encode()
    assert second_reply in out[out.rindex(b"Hello there"):]
    term.wait_for_prompt(3)
    assert term.close() == 0
    history = (tmp_path / "cache" / "hybridmoe" / "chat_history").read_text()
    assert "+Hello there" in history


def test_the_history_outlives_the_session_unless_no_history(chat, tmp_path):
    history = tmp_path / "cache" / "hybridmoe" / "chat_history"
    history.parent.mkdir(parents=True)
    history.write_text("\n# earlier\n+What is MoE?\n")
    term = chat()
    term.wait_for_prompt(1)
    term.type(UP)
    term.read_until(lambda out: b"What is MoE?" in out)
    term.type(b"\x15/exit\r")  # Ctrl-U clears the recalled line
    term.read_until(lambda out: term.proc.poll() is not None)
    assert term.proc.wait(timeout=WAIT_S) == 0
    assert "+/exit" in history.read_text()

    term = chat("--no-history")
    term.wait_for_prompt(1)
    term.type(b"Hi\r")
    term.read_until(lambda out: STATS.search(out) is not None)
    term.wait_for_prompt(2)
    term.type(UP)
    term.type(b"\x15/exit\r")
    out = term.read_until(lambda out: term.proc.poll() is not None)
    assert term.proc.wait(timeout=WAIT_S) == 0 and b"What is MoE?" not in out
    assert "Hi" not in history.read_text()
