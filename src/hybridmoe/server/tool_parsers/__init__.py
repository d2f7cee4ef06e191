"""Tool-call parsers: one per output format, chosen by the markers the model's chat template writes.

A parser reads decoded model output as text, whole (parse) or streamed (stream), and knows nothing of the engine
or the server: ParsedOutput and Delta are all it answers with.
"""

from __future__ import annotations

from hybridmoe.server.tool_parsers.base import Delta, ParsedOutput, ToolCall, ToolParser, ToolStream, new_call_id
from hybridmoe.server.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from hybridmoe.server.tool_parsers.glm45 import Glm45ToolParser
from hybridmoe.server.tool_parsers.harmony import HarmonyToolParser
from hybridmoe.server.tool_parsers.hermes import HermesToolParser
from hybridmoe.server.tool_parsers.kimi_k2 import KimiK2ToolParser
from hybridmoe.server.tool_parsers.minimax_m2 import MiniMaxM2ToolParser
from hybridmoe.server.tool_parsers.mistral import MistralToolParser

__all__ = ["PARSERS", "Delta", "ParsedOutput", "ToolCall", "ToolParser", "ToolStream", "new_call_id",
           "parser_for_template"]

PARSERS: dict[str, type[ToolParser]] = {parser.name: parser for parser in (
    HermesToolParser, DeepSeekV3ToolParser, Glm45ToolParser, KimiK2ToolParser, HarmonyToolParser,
    MistralToolParser, MiniMaxM2ToolParser)}

TEMPLATE_MARKERS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("<minimax:tool_call>",), "minimax_m2"),
    (("<arg_key>",), "glm45"),
    (("<｜tool▁calls▁begin｜>",), "deepseek_v3"),
    (("<|tool_calls_section_begin|>",), "kimi_k2"),
    (("<|channel|>", "<|call|>"), "harmony"),
    (("[TOOL_CALLS]",), "mistral"),
    (("<tool_call>",), "hermes"),
)
"""The strings whose presence in a chat template names its format, checked in this order: GLM-4.5 before hermes, as its
template also writes <tool_call>."""


def parser_for_template(chat_template: str | None) -> ToolParser | None:
    """The parser of the format the chat template writes tool calls in; None when it shows no known marker."""
    for needed, name in TEMPLATE_MARKERS:
        if chat_template and all(marker in chat_template for marker in needed):
            return PARSERS[name]()
    return None
