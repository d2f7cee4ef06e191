"""EngineConfig's fields as command-line flags, one to one (--max-num-seqs -> max_num_seqs).

Shared by every command that builds an engine (run, chat, serve, bench, doctor, profile-experts), so
the flags read the same everywhere. FLAGS holds each field's group, one line of help, its values and
its default in words; config.py's field docstrings say the rest. A field without an entry is an error
at parser construction, so a new EngineConfig field cannot go missing from the CLI unnoticed.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from hybridmoe.config import (DTYPES, EXPERT_BACKENDS, EXPERT_FORMATS, EXPERT_PLACEMENTS, KV_CACHE_DTYPES,
                              PREFILL_STREAMING, VERIFY_EXPERTS, EngineConfig)

GROUPS = ("model", "engine", "GPU")
"""The engine flags' argument groups, in --help order."""

GPU_GROUP_DESCRIPTION = "where routed experts go when a GPU runs the model (--device cuda)"


@dataclass(frozen=True)
class Flag:
    group: str
    """One of GROUPS."""
    help: str
    """One short line: what the flag does."""
    default: str
    """The default in words, as --help prints it after "default:"."""
    metavar: str = ""
    """The value's placeholder (N, SIZE, DIR); empty for an on/off flag or one with choices."""
    choices: tuple = ()
    """The allowed values, shown as a|b|c."""
    type: type = str


FLAGS: dict[str, Flag] = {
    "dtype": Flag("model", "compute dtype of the non-expert weights",
                  "auto, the checkpoint's", choices=DTYPES),
    "max_model_len": Flag("model", "longest prompt + reply, in tokens",
                          "the model's, at most what the KV cache holds", "N", type=int),
    "kv_cache_budget": Flag("engine", "memory of the paged KV cache, e.g. 8GiB (sets how much context fits)",
                            "max-num-seqs x 4096 tokens", "SIZE"),
    "kv_cpu_budget": Flag("engine", "host memory for KV blocks evicted from the GPU's cache, e.g. 32GiB; 0: none",
                          "as large as the GPU's KV cache (none on the CPU)", "SIZE"),
    "kv_cache_dtype": Flag("engine", "KV cache in the compute dtype, or float8 (half of bf16's memory)", "auto",
                           choices=KV_CACHE_DTYPES),
    "kv_block_size": Flag("engine", "positions per KV-cache block", "64", choices=(16, 32, 64, 128, 256), type=int),
    "prefix_caching": Flag("engine", "reuse the KV cache of earlier prompts that start the same way", "on",
                           type=bool),
    "cache_dir": Flag("model", "where packed experts and GGUF metadata are kept; '' keeps none",
                      "$XDG_CACHE_HOME/hybridmoe or ~/.cache/hybridmoe", "DIR"),
    "verify_experts": Flag("model", "check packed experts on load: every byte, or the headers only",
                           "full", choices=VERIFY_EXPERTS),
    "revision": Flag("model", "branch, tag or commit hash of a Hugging Face repo id given as --model",
                     "the repo's default branch", "REV"),
    "lora": Flag("model", "a PEFT LoRA adapter directory, merged into the weights at load", "none", "DIR"),
    "mtp": Flag("model", "load the multi-token-prediction module of Qwen3-Next / Qwen3.5-MoE (mtp_logits)",
                "off", type=bool),
    "device": Flag("engine", "where attention, dense layers and the KV cache run",
                   "auto, cuda when torch sees a GPU", choices=("auto", "cpu", "cuda")),
    "max_num_seqs": Flag("engine", "most sequences decoded together (the batch)", "8", "N", type=int),
    "max_num_batched_tokens": Flag("engine", "most tokens per step; longer prompts prefill in chunks",
                                   "2048", "N", type=int),
    "expert_backend": Flag("engine", "what runs routed experts: the C++ engine or the torch reference",
                           "auto, native when built and the dtype suits it", choices=EXPERT_BACKENDS),
    "expert_format": Flag("engine", "routed experts' format in the native engine",
                          "auto, the nearest to the checkpoint's", choices=EXPERT_FORMATS),
    "expert_group_size": Flag("engine", "int4 group size", "the checkpoint's, else 128",
                              choices=(32, 64, 128), type=int),
    "expert_zero_points": Flag("engine", "int4 groups with a zero point (asymmetric)",
                               "on for GPTQ/AWQ checkpoints, else off", type=bool),
    "tensor_parallel_size": Flag("engine", "processes that split attention by heads (GPUs on CUDA); rank 0 runs "
                                 "the experts", "1", "N", type=int),
    "cpu_threads": Flag("engine", "threads of the native expert engine, 1-1024", "every core", "N", type=int),
    "gpu_memory_budget": Flag("GPU", "GPU memory to use in all; what the rest leaves holds routed experts",
                              "90%% of free memory with the native engine, else none", "SIZE"),
    "expert_placement": Flag("GPU", "which routed experts fill the budget", "uniform", choices=EXPERT_PLACEMENTS),
    "expert_stats": Flag("GPU", "routing counts from `hybridmoe profile-experts` (frequency needs them)",
                         "none", "FILE"),
    "gpu_experts_per_layer": Flag("GPU", "routed experts per layer on the GPU, instead of the budget's count",
                                  "from the budget", "N", type=int),
    "gpu_experts_packed": Flag("GPU", "keep GPU experts in the CPU's int4/int8 codes, not the model's dtype",
                               "on", type=bool),
    "deferred_experts": Flag("GPU", "run each token's K weakest experts one layer late (0 is exact)",
                             "0", "K", type=int),
    "cuda_graph": Flag("GPU", "replay each decode step as one CUDA graph", "on", type=bool),
    "prefill_streaming": Flag("GPU", "stream packed experts to the GPU for long prefill steps",
                              "auto, when PCIe beats the CPU", choices=PREFILL_STREAMING),
    "prefill_streaming_tokens": Flag("GPU", "fewest tokens in a step that streams",
                                     "measured, as `hybridmoe doctor` prints", "N", type=int),
}
"""EngineConfig field -> its flag. Every field has exactly one entry (tests/unit/test_cli_help.py)."""


MODEL_HELP = "a Hugging Face model directory, a .gguf file, or a Hub repo id (org/name, org/name:QUANT)"


def add_model_argument(parser: argparse.ArgumentParser, help_text: str = MODEL_HELP) -> argparse._ArgumentGroup:
    """The "model" group with the required --model; pass it on to add_engine_arguments."""
    group = parser.add_argument_group("model")
    group.add_argument("--model", required=True, metavar="PATH", help=help_text)
    return group


def add_engine_arguments(parser: argparse.ArgumentParser, model_group: argparse._ArgumentGroup | None = None) -> None:
    """One flag per EngineConfig field, in the groups of GROUPS ("model" joins model_group when given)."""
    groups = {"model": model_group or parser.add_argument_group("model"),
              "engine": parser.add_argument_group("engine"),
              "GPU": parser.add_argument_group("GPU", GPU_GROUP_DESCRIPTION)}
    for f in fields(EngineConfig):
        flag = flag_for(f.name)
        group = groups[flag.group]
        name = "--" + f.name.replace("_", "-")
        help_text = f"{'(GPU) ' if flag.group == 'GPU' else ''}{flag.help} (default: {flag.default})"
        if flag.type is bool:
            group.add_argument(name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif flag.choices:
            group.add_argument(name, type=flag.type, choices=flag.choices, default=None,
                               metavar="|".join(map(str, flag.choices)), help=help_text)
        else:
            group.add_argument(name, type=flag.type, default=None, metavar=flag.metavar, help=help_text)


def flag_for(field_name: str) -> Flag:
    try:
        return FLAGS[field_name]
    except KeyError:
        raise LookupError(f"EngineConfig.{field_name} has no entry in FLAGS (hybridmoe/commands/engine_args.py): "
                       f"give it a group, a line of help and its default in words") from None


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine options given on the command line, as EngineConfig keyword arguments."""
    return {f.name: getattr(args, f.name) for f in fields(EngineConfig) if getattr(args, f.name, None) is not None}
