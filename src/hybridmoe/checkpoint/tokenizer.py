"""A small byte-level BPE tokenizer with a family's special tokens and chat template.

Trained (deterministically, in a fraction of a second) on a short built-in English text, so that
ordinary prompts split into word-sized pieces; any byte sequence still encodes (byte-level).
Special tokens take the first ids, so they stay below any config's vocab_size. For a real-shape
vocab (32k-152k) the trained vocabulary is filled up with letter strings ("Ġqx", "zvk", ...) that
no merge ever produces: encoding is unchanged, but every id a random model samples decodes to text.
"""

from __future__ import annotations

import itertools
import json
import string
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

_TEXT = """\
The quick brown fox jumps over the lazy dog. A mixture of experts model routes each token to a few
experts out of many, so it holds far more knowledge than it spends compute on. Hello! How are you
today? I am fine, thank you. What is the capital of France? The capital of France is Paris.
Once upon a time, there was a little girl who lived in a village near the forest. Every morning she
walked to the river to fetch water, and every evening she told her grandmother a story about what
she had seen. Write a short poem about the sea. The sea is wide and deep and blue; it keeps the
secrets of the moon. Please explain how a computer works. A computer reads instructions from memory,
computes with numbers, and writes the results back. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024.
You are a helpful assistant. The user asks a question and the assistant answers it clearly and
kindly. Can you help me with my homework? Of course, I would be happy to help. Let us think step by
step. First, we read the problem. Then, we write down what we know. Finally, we check the answer.
[INST] Tell me a joke. [/INST] Why did the scarecrow win an award? Because he was outstanding in
his field. The weather is nice today, and the sun is shining over the hills and the green fields.
"""


@dataclass(frozen=True)
class TokenizerFamily:
    special_tokens: tuple[str, ...]  # in id order, from 0
    bos: str | None  # added in front of plain-text encodings (and used by the template), if set
    eos: str  # the end-of-turn token: the template closes assistant turns with it; config eos_token_id
    pad: str
    unk: str | None
    extra_eos: tuple[str, ...]  # further stop tokens for generation_config.json
    chat_template: str


# ChatML as Qwen2.5 / Qwen3 lay it out: tools listed in the system turn between <tools> tags, the assistant's calls
# as <tool_call> JSON, tool results as <tool_response> inside a user turn (consecutive ones together), an earlier
# answer's reasoning left out; enable_thinking=false opens the answer with an empty <think></think>.
_CHATML = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '"
    " + 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'"
    " + '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if (loop.first and message['content']) or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{%- set fn = call['function'] %}"
    "{{- '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

# DeepSeek-V3's layout: the system text first (then the tools, each with its JSON), user and assistant turns
# marked by their tokens; the assistant's calls in a tool-calls section, each `function<｜tool▁sep｜>NAME` and its
# arguments in a fenced JSON block; tool results in a tool-outputs section (consecutive ones together).
_DEEPSEEK = (
    "{{- bos_token }}"
    "{%- for message in messages if message['role'] == 'system' %}{{- message['content'] }}{%- endfor %}"
    "{%- if tools %}{{- '\\n\\n## Tools\\n\\nYou have the following functions available:\\n' }}"
    "{%- for tool in tools %}"
    "{{- '\\n- `' + tool['function']['name'] + '`:\\n```json\\n' + (tool['function'] | tojson) + '\\n```' }}"
    "{%- endfor %}{%- endif %}"
    "{%- set state = namespace(outputs=false) %}"
    "{%- for message in messages %}"
    "{%- if message['role'] != 'tool' and state.outputs %}"
    "{{- '<｜tool▁outputs▁end｜>' }}{%- set state.outputs = false %}"
    "{%- endif %}"
    "{%- if message['role'] == 'user' %}{{- '<｜User｜>' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<｜Assistant｜>' + (message['content'] or '') }}"
    "{%- if message.get('tool_calls') %}{{- '<｜tool▁calls▁begin｜>' }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set args = call['function']['arguments'] %}"
    "{{- '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + call['function']['name'] + '\\n```json\\n'"
    " + (args if args is string else args | tojson) + '\\n```<｜tool▁call▁end｜>' }}"
    "{%- endfor %}{{- '<｜tool▁calls▁end｜>' }}{%- endif %}"
    "{{- '<｜end▁of▁sentence｜>' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if not state.outputs %}{{- '<｜tool▁outputs▁begin｜>' }}{%- set state.outputs = true %}{%- endif %}"
    "{{- '<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if state.outputs %}{{- '<｜tool▁outputs▁end｜>' }}{%- endif %}"
    "{%- if add_generation_prompt %}{{- '<｜Assistant｜>' }}{%- endif %}"
)

# GLM-4.5's layout: [gMASK]<sop>, then turns opened by <|system|>, <|user|>, <|assistant|>; tools listed in a
# system turn between <tools> tags; the assistant's calls as <tool_call>NAME with one <arg_key>/<arg_value> pair
# per argument (strings bare, other values as JSON); tool results in an <|observation|> turn (consecutive ones
# together) as <tool_response> blocks; enable_thinking=false opens the answer with an empty <think></think>. No
# token closes a turn: an answer ends where the model opens the next one (<|user|>, <|observation|>), its EOS.
_GLM = (
    "{{- '[gMASK]<sop>' }}"
    "{%- if tools %}"
    "{{- '<|system|>\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, output the function name and arguments within the following'"
    " + ' XML format:\\n<tool_call>{function-name}\\n<arg_key>{arg-key-1}</arg_key>\\n<arg_value>{arg-value-1}'"
    " + '</arg_value>\\n...\\n</tool_call>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|observation|>' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|assistant|>\\n' + (message['content'] or '') }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{{- '\\n<tool_call>' + call['function']['name'] + '\\n' }}"
    "{%- set args = call['function']['arguments'] %}"
    "{%- for key, value in (args.items() if args is mapping else []) %}"
    "{{- '<arg_key>' + key + '</arg_key>\\n<arg_value>' + (value if value is string else value | tojson)"
    " + '</arg_value>\\n' }}"
    "{%- endfor %}"
    "{{- '</tool_call>' }}"
    "{%- endfor %}"
    "{%- else %}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '\\n<think></think>' }}{%- endif %}"
    "{%- endif %}"
)

# MiniMax-M2's layout: ]~!b[, then turns opened by ]~b]system, ]~b]user, ]~b]ai, ]~b]tool and closed by [e~[; the
# system turn always comes (its default text "You are a helpful assistant."), with the tools after it between <tools>
# tags, one <tool> each; the assistant's calls in a <minimax:tool_call> block, one <invoke name=...> per call and one
# <parameter name=...> per argument (strings bare, other values as JSON); tool results as <response> blocks in one
# tool turn (consecutive ones together); the answer opens with <think>. Simpler than the release's template: an
# earlier answer's reasoning is left out, and no current date or model identity is filled in.
_MINIMAX = (
    "{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' "
    "else 'You are a helpful assistant.' %}"
    "{{- ']~!b[]~b]system\\n' + system }}"
    "{%- if tools %}"
    "{{- '\\n\\n# Tools\\nYou may call one or more tools to assist with the user query.\\n'"
    " + 'Here are the tools available in JSONSchema format:\\n\\n<tools>\\n' }}"
    "{%- for tool in tools %}{{- '<tool>' + (tool['function'] | tojson) + '</tool>\\n' }}{%- endfor %}"
    "{{- '</tools>\\n\\nWhen making tool calls, use XML format to invoke tools and pass parameters:\\n'"
    " + '\\n<minimax:tool_call>\\n<invoke name=\"tool-name-1\">\\n'"
    " + '<parameter name=\"param-key-1\">param-value-1</parameter>\\n...\\n</invoke>\\n</minimax:tool_call>' }}"
    "{%- endif %}"
    "{{- '[e~[\\n' }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- ']~b]tool' }}{%- endif %}"
    "{{- '\\n<response>' + message['content'] + '</response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '[e~[\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- ']~b]ai\\n' + (message['content'] or '') }}"
    "{%- if message.get('tool_calls') %}{{- '\\n<minimax:tool_call>\\n' }}"
    "{%- for call in message['tool_calls'] %}"
    "{{- '<invoke name=\"' + call['function']['name'] + '\">\\n' }}"
    "{%- set args = call['function']['arguments'] %}"
    "{%- for key, value in (args.items() if args is mapping else []) %}"
    "{{- '<parameter name=\"' + key + '\">' + (value if value is string else value | tojson) + '</parameter>\\n' }}"
    "{%- endfor %}"
    "{{- '</invoke>\\n' }}"
    "{%- endfor %}"
    "{{- '</minimax:tool_call>' }}"
    "{%- endif %}"
    "{{- '[e~[\\n' }}"
    "{%- else %}"
    "{{- ']~b]' + message['role'] + '\\n' + message['content'] + '[e~[\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- ']~b]ai\\n<think>\\n' }}{%- endif %}"
)

# gpt-oss's harmony format, as the release's template renders system, user and assistant turns and earlier tool
# calls; the rest of the release's template (tool definitions, builtin tools) is not rendered. Every message is
# <|start|>ROLE<|message|>TEXT<|end|>; a system turn always comes first (model identity, knowledge cutoff, today's
# date, "Reasoning: " reasoning_effort (default medium), the valid channels); a system or developer message given
# first becomes a developer turn under "# Instructions"; an assistant answer is <|start|>assistant<|channel|>final
# <|message|>TEXT<|end|>, its analysis channel (the reasoning, message['thinking']) dropped, except for a last
# assistant message with no generation prompt: its thinking in the analysis channel, then the answer closed by
# <|return|> (the token that ends a generation); the generation prompt is <|start|>assistant, after which the model
# writes its channels. An earlier call is <|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>
# ARGUMENTS<|call|>, its result <|start|>functions.NAME to=assistant<|channel|>commentary<|message|>"TEXT"<|end|>
# (the text as a JSON string). The tools themselves (the release's TypeScript-like namespace in the developer turn)
# are not listed, so a request's tools reach the model only through earlier calls.
_HARMONY = (
    "{%- set identity = model_identity if model_identity is defined "
    "else 'You are ChatGPT, a large language model trained by OpenAI.' %}"
    "{%- set effort = reasoning_effort if reasoning_effort is defined else 'medium' %}"
    "{{- '<|start|>system<|message|>' + identity + '\\nKnowledge cutoff: 2024-06\\nCurrent date: '"
    " + strftime_now('%Y-%m-%d') + '\\n\\nReasoning: ' + effort + '\\n\\n# Valid channels: analysis, commentary, "
    "final. Channel must be included for every message.<|end|>' }}"
    "{%- set first = messages[0]['role'] if messages else none %}"
    "{%- set last_call = namespace(name='') %}"
    "{%- if first in ('system', 'developer') %}"
    "{{- '<|start|>developer<|message|># Instructions\\n\\n' + messages[0]['content'] + '<|end|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if loop.first and first in ('system', 'developer') %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set args = call['function']['arguments'] %}"
    "{%- set last_call.name = call['function']['name'] %}"
    "{{- '<|start|>assistant to=functions.' + last_call.name + '<|channel|>commentary json<|message|>'"
    " + (args if args is string else args | tojson) + '<|call|>' }}"
    "{%- endfor %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|start|>functions.' + (message.get('name') or last_call.name) + ' to=assistant<|channel|>commentary'"
    " + '<|message|>' + (message['content'] | tojson) + '<|end|>' }}"
    "{%- elif message['role'] == 'assistant' and loop.last and not add_generation_prompt %}"
    "{%- if message.get('thinking') %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message['thinking'] + '<|end|>' }}"
    "{%- endif %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message['content'] + '<|return|>' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message['content'] + '<|end|>' }}"
    "{%- elif message['role'] == 'user' %}"
    "{{- '<|start|>user<|message|>' + message['content'] + '<|end|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)

# Mistral's [INST] format: a system message is put in front of the first user message; the prompt
# for the assistant is the closing [/INST] itself, so add_generation_prompt adds nothing.
_MIXTRAL = (
    "{{- bos_token }}"
    "{%- set system = namespace(text='') %}"
    "{%- for message in messages if message['role'] == 'system' %}"
    "{%- set system.text = system.text + message['content'] + '\\n\\n' %}"
    "{%- endfor %}"
    "{%- for message in messages if message['role'] != 'system' %}"
    "{%- if message['role'] == 'user' %}"
    "{{- '[INST] ' + (system.text if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- ' ' + message['content'] + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
)

_QWEN = TokenizerFamily(("<|endoftext|>", "<|im_start|>", "<|im_end|>"), bos=None, eos="<|im_end|>",
                        pad="<|endoftext|>", unk=None, extra_eos=("<|endoftext|>",), chat_template=_CHATML)
_DS = TokenizerFamily(("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>",
                       "<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
                       "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>",
                       "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"),
                      bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", pad="<｜▁pad▁｜>", unk=None,
                      extra_eos=(), chat_template=_DEEPSEEK)
_MX = TokenizerFamily(("<unk>", "<s>", "</s>"), bos="<s>", eos="</s>", pad="</s>", unk="<unk>",
                      extra_eos=(), chat_template=_MIXTRAL)

_GLM4 = TokenizerFamily(("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                         "<|observation|>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                         "</arg_value>", "<tool_response>", "</tool_response>", "<think>", "</think>"),
                        bos=None, eos="<|user|>", pad="<|endoftext|>", unk=None,
                        extra_eos=("<|endoftext|>", "<|observation|>"), chat_template=_GLM)

_MINIMAX_M2 = TokenizerFamily(("]~!b[", "]~b]", "[e~[", "<think>", "</think>", "<minimax:tool_call>",
                               "</minimax:tool_call>"),
                              bos="]~!b[", eos="[e~[", pad="[e~[", unk=None, extra_eos=(), chat_template=_MINIMAX)

# o200k_harmony's special tokens (their ids there: 199998, 199999, 200002, 200003, 200005 to 200008, 200012)
_GPT_OSS = TokenizerFamily(("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>",
                            "<|start|>", "<|end|>", "<|message|>", "<|call|>"),
                           bos=None, eos="<|return|>", pad="<|endoftext|>", unk=None,
                           extra_eos=("<|endoftext|>", "<|call|>"), chat_template=_HARMONY)

FAMILIES = {"qwen2_moe": _QWEN, "qwen3_moe": _QWEN, "deepseek_v2": _DS, "deepseek_v3": _DS, "deepseek_v32": _DS,
            "mixtral": _MX, "glm4_moe": _GLM4, "minimax_m2": _MINIMAX_M2, "gpt_oss": _GPT_OSS, "qwen3_next": _QWEN,
            "qwen3_5_moe": _QWEN}
"""Architecture -> its tokenizer family."""


TRAINED_VOCAB = 512


def _fill_vocab(tok: Tokenizer, vocab_size: int) -> Tokenizer:
    """Extend tok's BPE vocabulary (ids 0..n-1, specials included) to vocab_size ids with letter
    strings, with and without the byte-level space mark "Ġ", that no merge produces."""
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    words = ("".join(chars) for n in itertools.count(2)
             for chars in itertools.product(string.ascii_lowercase, repeat=n))
    for token in (t for w in words for t in ("\u0120" + w, w)):
        if len(vocab) >= vocab_size:
            break
        vocab.setdefault(token, len(vocab))
    return Tokenizer.from_str(json.dumps(data))


def build_tokenizer(family: TokenizerFamily, vocab_size: int) -> Tokenizer:
    """Train the byte-level BPE on the built-in text (up to TRAINED_VOCAB tokens, specials included),
    then fill it up to vocab_size."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab_size, TRAINED_VOCAB),
                                  special_tokens=list(family.special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_TEXT.splitlines(), trainer=trainer)
    if vocab_size > tok.get_vocab_size():
        tok = _fill_vocab(tok, vocab_size)
    if family.bos is None:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        bos = (family.bos, tok.token_to_id(family.bos))
        tok.post_processor = processors.TemplateProcessing(single=f"{family.bos} $A",
                                                           pair=f"{family.bos} $A {family.bos} $B",
                                                           special_tokens=[bos])
    return tok


def write_tokenizer(out_dir: Path, arch: str, vocab_size: int) -> dict:
    """Write tokenizer.json + tokenizer_config.json; return the token ids the configs need:
    bos/eos/pad_token_id and generation_eos (the end-of-turn token, then other stop tokens)."""
    family = FAMILIES[arch]
    tok = build_tokenizer(family, vocab_size)
    tok.save(str(out_dir / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in family.special_tokens}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": family.bos,
        "eos_token": family.eos,
        "pad_token": family.pad,
        "unk_token": family.unk,
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "chat_template": family.chat_template,
        "added_tokens_decoder": {str(ids[t]): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                               "normalized": False, "single_word": False}
                                 for t in family.special_tokens},
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
    return {
        "bos_token_id": ids[family.bos] if family.bos else ids[family.special_tokens[0]],
        "eos_token_id": ids[family.eos],
        "pad_token_id": ids[family.pad],
        "generation_eos": [ids[family.eos]] + [ids[t] for t in family.extra_eos],
    }
