"""`hybridmoe chat --model PATH`: an interactive multi-turn chat through the model's chat template.

On a terminal the prompt edits its line and recalls earlier ones (arrow keys, Ctrl-R) through prompt_toolkit,
and keeps them in the cache directory (history_path) unless --no-history; from a pipe it reads plain lines.
/clear forgets the conversation, /exit (or Ctrl-D) quits, Ctrl-C stops the reply being written and keeps the
session (the part already written stays in the history). After each reply a line on stderr gives its tokens
and speed, as run's does, and an empty reply says why it is empty.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Callable

from hybridmoe.commands.engine_args import add_engine_arguments, add_model_argument, engine_kwargs
from hybridmoe.commands.run import summary_line
from hybridmoe.commands.sampling_args import add_sampling_arguments, sampling_params
from hybridmoe.errors import HybridMoEError

HELP = "/clear forgets the conversation, /exit or Ctrl-D quits, Ctrl-C stops a reply"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = add_model_argument(parser)
    chat = parser.add_argument_group("chat")
    chat.add_argument("--system", metavar="TEXT",
                      help="a system message at the start of the conversation (default: none)")
    chat.add_argument("--no-history", action="store_true",
                      help="keep no record of the lines typed (default: kept in "
                           "$XDG_CACHE_HOME/hybridmoe/chat_history or ~/.cache/hybridmoe/chat_history)")
    add_sampling_arguments(parser)
    add_engine_arguments(parser, model)


def run(args: argparse.Namespace) -> int:
    from hybridmoe.commands.doctor import print_choices
    from hybridmoe.llm import LLM

    llm = LLM(args.model, **engine_kwargs(args))
    if llm.tokenizer is None or llm.tokenizer.chat_template is None:
        raise HybridMoEError(f"{args.model} has no chat template (tokenizer_config.json chat_template); "
                             "use `hybridmoe run` for plain completion")
    session = ChatSession(llm, sampling_params(args, room=llm.engine.max_model_len), args.system)
    print_choices(llm.engine)
    print(HELP, file=sys.stderr)
    read_line = line_reader(None if args.no_history else history_path())
    while True:
        try:
            line = read_line(">>> ").strip()
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:  # at the prompt: drop the line, keep the session
            print()
            continue
        if line == "/exit":
            return 0
        if line == "/clear":
            session.clear()
            print("(conversation cleared)", file=sys.stderr)
        elif line.startswith("/"):
            print(f"unknown command {line.split()[0]}; {HELP}", file=sys.stderr)
        elif line:
            session.say(line)


def history_path() -> Path:
    """$XDG_CACHE_HOME/hybridmoe/chat_history, or ~/.cache/hybridmoe/chat_history: beside the expert cache."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hybridmoe" / "chat_history"


def line_reader(history: Path | None) -> Callable[[str], str]:
    """prompt(text) -> the line typed: prompt_toolkit's line editor on a terminal, else input().

    Either raises EOFError at the end of input (Ctrl-D) and KeyboardInterrupt on Ctrl-C."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        return input
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import FileHistory, InMemoryHistory

    if history is not None:
        try:
            history.parent.mkdir(parents=True, exist_ok=True)
            history.touch()
        except OSError as e:
            print(f"(no line history: cannot write {history}: {e.strerror or e})", file=sys.stderr)
            history = None
    return PromptSession(history=InMemoryHistory() if history is None else FileHistory(str(history))).prompt


class ChatSession:
    def __init__(self, llm, params, system: str | None = None):
        self.llm = llm
        self.params = params
        """Each reply's sampling; max_tokens caps a reply, which also ends where the context does."""
        self.system = system
        self.history: list[dict] = []
        self.clear()

    def clear(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    def say(self, text: str) -> None:
        """Send a user message and stream the reply to stdout; Ctrl-C cuts the reply short."""
        self.history.append({"role": "user", "content": text})
        try:
            ids = self.llm.encode_chat(self.history)
        except HybridMoEError as e:
            self.history.pop()
            print(f"error: {e}", file=sys.stderr)
            return
        room = self.llm.engine.max_model_len - len(ids)
        if room < 1:
            self.history.pop()
            print(f"the conversation fills the context ({len(ids)} of {self.llm.engine.max_model_len} tokens); "
                  "/clear to start over", file=sys.stderr)
            return
        params = dataclasses.replace(self.params, max_tokens=min(self.params.max_tokens, room))
        reply = self._stream(ids, params)
        self.history.append({"role": "assistant", "content": reply})

    def _stream(self, ids: list[int], params) -> str:
        """Writes the reply to stdout as it comes, then its summary line (and why it is empty) to stderr."""
        pieces, out, first, stopped = [], None, None, False
        start = time.perf_counter()
        stream = self.llm.stream(ids, params)
        try:
            for out in stream:
                first = first or time.perf_counter()
                pieces.append(out.new_text)
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
                if out.error is not None:
                    sys.stdout.write(f" [error: {out.error}]")
        except KeyboardInterrupt:
            stopped = True
            sys.stdout.write(" [stopped]")
        finally:
            stream.close()  # aborts the request if it did not finish
            sys.stdout.write("\n")
            sys.stdout.flush()
        reply = "".join(pieces)
        if out is not None:
            print(summary_line(out, start, first, time.perf_counter(), "stopped" if stopped else None),
                  file=sys.stderr)
            if not stopped and out.error is None and not reply.strip():
                why = empty_reason(out, params.max_tokens, len(ids), self.llm.engine.max_model_len)
                print(f"(empty reply: {why})", file=sys.stderr)
        return reply


def empty_reason(out, max_tokens: int, prompt_len: int, max_model_len: int) -> str:
    """Why a finished reply holds no visible text."""
    n = len(out.token_ids)
    if out.finish_reason == "stop" and n <= 1:
        return "the model produced a stop token at once"
    if out.finish_reason == "stop":
        return f"its {n} tokens end in a stop string or are special tokens, which are not shown"
    if prompt_len + max_tokens >= max_model_len:
        return f"the context is full ({max_model_len} tokens); /clear to start over"
    return f"its {n} tokens (--max-new-tokens {max_tokens}) decode to no visible text"
