"""Chat-format training data: JSONL conversations rendered with the tokenizer's chat template, labelled on the
assistant's tokens only.

Each line of the file is one conversation, {"messages": [{"role": ..., "content": ...}, ...]} with an optional
"tools" list for templates that take one; blank lines are skipped. A conversation becomes one Example: the
template's rendering tokenized, labels equal to the token ids on what the assistant writes (each assistant turn's
text and the template's end-of-turn marker after it: the model learns to stop) and IGNORE everywhere else.

Where each assistant turn lies in the rendered text is found by rendering prefixes of the conversation: the
conversation up to the turn with the generation prompt must begin the full rendering (where it ends, the assistant's
text starts), and the conversation through the turn gives where it ends. A template that renders a final assistant
turn unlike an earlier one (Qwen3's drops earlier turns' reasoning) is handled by finding the turn's content, then
its end-of-turn marker, in the full rendering. Spans are characters; a token is labelled when it starts inside one
(the tokenizer's offsets), so a token that merges the prompt's last characters with the answer's first stays a
prompt token, as it is when the model generates after that prompt. Trailing whitespace after the end-of-turn marker
(ChatML's newline) is not the model's to write and stays unlabelled.

Bad input is a ChatDataError that names the file and line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from jinja2 import TemplateError

from hybridmoe.errors import HybridMoEError

IGNORE = -100
"""The label of a token the loss leaves out (torch's cross_entropy ignore_index)."""


class ChatDataError(HybridMoEError):
    """A training file or one of its conversations that cannot be used; the message names the line."""


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]
    """input_ids on the assistant's tokens, IGNORE elsewhere."""
    line: int
    """The conversation's line in the file (from 1)."""

    @property
    def trained_tokens(self) -> int:
        return sum(label != IGNORE for label in self.labels)


@dataclass(frozen=True)
class ChatData:
    examples: list[Example]
    too_long: list[int]
    """Lines of the conversations left out because they tokenize to more than max_length tokens."""


def load_chat_data(path: str | Path, tokenizer, max_length: int) -> ChatData:
    """Every conversation of the JSONL file at path as an Example; those longer than max_length tokens are skipped
    (their lines listed in too_long). ChatDataError for a missing file, a bad line, or a file with no conversation
    that fits."""
    path = Path(path)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ChatDataError("the model's tokenizer has no chat template to render the conversations with")
    examples, too_long = [], []
    for line_no, record in read_conversations(path):
        where = f"{path} line {line_no}"
        example = conversation_example(tokenizer, record, line_no, where)
        if len(example.input_ids) > max_length:
            too_long.append(line_no)
        else:
            examples.append(example)
    if not examples:
        why = f"all {len(too_long)} are longer than --max-length {max_length} tokens" if too_long else "it is empty"
        raise ChatDataError(f"{path} has no conversation to train on: {why}")
    return ChatData(examples, too_long)


def read_conversations(path: Path) -> list[tuple[int, dict]]:
    """(line number, {"messages": [...], "tools": [...] or None}) for each non-blank line, checked."""
    if not path.is_file():
        raise ChatDataError(f"{path}: no such file" if not path.exists() else f"{path} is not a file")
    conversations = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                conversations.append((line_no, parse_line(line, f"{path} line {line_no}")))
    return conversations


def parse_line(line: str, where: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ChatDataError(f"{where} is not JSON ({e.msg} at column {e.colno})") from None
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise ChatDataError(f'{where}: expected an object with a non-empty "messages" list, '
                            f'{{"messages": [{{"role": "user", "content": "..."}}, ...]}}')
    for i, message in enumerate(messages, start=1):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ChatDataError(f'{where}: message {i} is not an object with a "role"')
    if not any(m["role"] == "assistant" for m in messages):
        raise ChatDataError(f"{where} has no assistant message to learn from")
    tools = record.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ChatDataError(f'{where}: "tools" must be a list')
    return {"messages": messages, "tools": tools}


def conversation_example(tokenizer, record: dict, line_no: int, where: str) -> Example:
    """One conversation tokenized, labelled on its assistant turns."""
    messages, tools = record["messages"], record["tools"]

    def render(upto: int, generation_prompt: bool = False) -> str:
        try:
            return tokenizer.apply_chat_template(messages[:upto], tools=tools, tokenize=False,
                                                 add_generation_prompt=generation_prompt)
        except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            # the template's own raise_exception, an undefined key, None added to a string: the conversation's fault
            raise ChatDataError(f"{where}: the chat template cannot render this conversation "
                                f"({type(e).__name__}: {e})") from None

    full = render(len(messages))
    spans = [assistant_span(full, messages, i, render, where) for i, m in enumerate(messages)
             if m["role"] == "assistant"]
    input_ids, labels = tokens_with_labels(tokenizer, full, spans)
    if all(label == IGNORE for label in labels):
        raise ChatDataError(f"{where}: its assistant messages render to no tokens")
    return Example(input_ids, labels, line_no)


def assistant_span(full: str, messages: list[dict], i: int, render, where: str) -> tuple[int, int]:
    """[start, end) in the full rendering of assistant message i: its text and end-of-turn marker."""
    prompt = render(i, generation_prompt=True)
    if not full.startswith(prompt):
        raise ChatDataError(f"{where}: the chat template renders the conversation before message {i + 1} (an "
                            "assistant's) differently from how the whole conversation begins, so its tokens cannot "
                            "be told from the prompt's")
    start = len(prompt)
    through = render(i + 1)
    if full.startswith(through) and through.startswith(prompt):
        end = len(through)
    else:
        end = _end_by_content(full, start, through, messages[i], where, i)
    return start, start + len(full[start:end].rstrip())


def _end_by_content(full: str, start: int, through: str, message: dict, where: str, i: int) -> int:
    """The end of assistant message i where the template renders it as the last turn unlike in the conversation:
    its content found in the full rendering, then the end-of-turn marker the last-turn rendering puts after it."""
    content = message.get("content")
    content = content.strip() if isinstance(content, str) else ""
    found = full.find(content, start) if content else -1
    if found < 0 or content not in through:
        raise ChatDataError(f"{where}: cannot find assistant message {i + 1} in the conversation as the chat "
                            "template renders it")
    end = found + len(content)
    closing = through[through.rfind(content) + len(content):].rstrip()
    return end + len(closing) if full.startswith(closing, end) else end


def tokens_with_labels(tokenizer, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """text's token ids (the template wrote any BOS itself) and labels: the id where the token starts inside a
    span, else IGNORE."""
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    labels = [token if any(s <= begin < e for s, e in spans) else IGNORE
              for token, (begin, _) in zip(ids, offsets)]
    return list(ids), labels
