"""`hybridmoe chat --model DIR`: an interactive multi-turn chat through the model's chat template.

/clear forgets the conversation, /exit (or Ctrl-D) quits, Ctrl-C stops the reply being written
and keeps the session (the part already written stays in the history).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from hybridmoe.commands.engine_args import add_engine_arguments, engine_kwargs
from hybridmoe.commands.sampling_args import add_sampling_arguments, sampling_params
from hybridmoe.errors import HybridMoEError

HELP = "/clear forgets the conversation, /exit or Ctrl-D quits, Ctrl-C stops a reply"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR", help="a Hugging Face model directory")
    parser.add_argument("--system", metavar="TEXT", help="a system message at the start of the conversation")
    add_sampling_arguments(parser, max_new_tokens=512)
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from hybridmoe.commands.doctor import print_choices
    from hybridmoe.llm import LLM

    llm = LLM(args.model, **engine_kwargs(args))
    if llm.tokenizer is None or llm.tokenizer.chat_template is None:
        raise HybridMoEError(f"{args.model} has no chat template (tokenizer_config.json chat_template); "
                             "use `hybridmoe run` for plain completion")
    session = ChatSession(llm, sampling_params(args), args.system)
    print_choices(llm.engine)
    print(HELP, file=sys.stderr)
    while True:
        try:
            line = input(">>> ").strip()
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


class ChatSession:
    def __init__(self, llm, params, system: str | None = None):
        self.llm = llm
        self.params = params
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
        pieces = []
        stream = self.llm.stream(ids, params)
        try:
            for out in stream:
                pieces.append(out.new_text)
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
                if out.error is not None:
                    sys.stdout.write(f" [error: {out.error}]")
        except KeyboardInterrupt:
            sys.stdout.write(" [stopped]")
        finally:
            stream.close()  # aborts the request if it did not finish
            sys.stdout.write("\n")
            sys.stdout.flush()
        self.history.append({"role": "assistant", "content": "".join(pieces)})
