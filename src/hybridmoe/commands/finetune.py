"""`hybridmoe finetune --model DIR --data train.jsonl --out adapter/`: train a LoRA adapter on chat conversations,
the routed experts running (frozen) in the native CPU engine. The training itself is hybridmoe.hf.finetune.

It needs transformers and peft (pip install 'hybridmoe[finetune]'): without them it says so in one line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybridmoe.config import DTYPES, EXPERT_FORMATS

MISSING_DEPENDENCIES = "hybridmoe finetune needs transformers and peft: pip install 'hybridmoe[finetune]'"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    io = parser.add_argument_group("model, data and output")
    io.add_argument("--model", required=True, metavar="DIR", help="a local Hugging Face checkpoint of an MoE model "
                    "(float weights: bf16, fp16 or fp32)")
    io.add_argument("--data", required=True, metavar="FILE", help='chat conversations, one JSON object a line: '
                    '{"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}, ...]}; the loss '
                    "covers the assistant's tokens only")
    io.add_argument("--out", required=True, metavar="DIR", help="where the adapter goes (peft's format: "
                    "adapter_config.json, adapter_model.safetensors), with checkpoint-STEP directories and "
                    "train_log.jsonl; new or empty unless --resume")
    io.add_argument("--resume", action="store_true", help="continue the run whose checkpoints --out holds, from "
                    "its latest (default: off)")
    lora = parser.add_argument_group("LoRA")
    lora.add_argument("--lora-rank", type=_positive_int, default=8, metavar="R", help="adapter rank (default: 8)")
    lora.add_argument("--lora-alpha", type=float, default=16.0, metavar="A",
                      help="adapter scale, alpha / rank multiplies its output (default: 16)")
    lora.add_argument("--lora-targets", default="attention", metavar="attention|attention+mlp|NAME,...",
                      help="the linear layers that get adapters: the attention projections, those and the shared "
                           "experts' and dense MLPs', or these module names (default: attention); the routed "
                           "experts get none")
    training = parser.add_argument_group("training")
    training.add_argument("--lr", type=float, default=1e-4, help="AdamW's learning rate, constant (default: 1e-4)")
    length = training.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=_positive_int, default=1, metavar="N",
                        help="passes over the data (default: 1)")
    length.add_argument("--max-steps", type=_positive_int, default=None, metavar="N",
                        help="optimizer steps to run instead of whole epochs")
    training.add_argument("--batch-size", type=_positive_int, default=1, metavar="N",
                          help="conversations per micro-batch (default: 1)")
    training.add_argument("--grad-accum", type=_positive_int, default=8, metavar="N",
                          help="micro-batches per optimizer step (default: 8)")
    training.add_argument("--max-length", type=_positive_int, default=2048, metavar="TOKENS",
                          help="longest conversation; longer ones are skipped, their lines printed (default: 2048)")
    training.add_argument("--max-grad-norm", type=float, default=1.0, metavar="X",
                          help="clip the gradient's norm to X, 0 for no clipping (default: 1.0)")
    training.add_argument("--save-every", type=_positive_int, default=None, metavar="N",
                          help="write a checkpoint (adapter, optimizer state, step) every N steps (default: none)")
    training.add_argument("--seed", type=int, default=0, help="the seed of the data order and of the adapters' initial weights (default: 0)")
    engine = parser.add_argument_group("model placement")
    formats = [f for f in EXPERT_FORMATS if f != "auto"]
    engine.add_argument("--expert-format", choices=formats, default="bf16", metavar="|".join(formats),
                        help="the routed experts' format in the CPU engine (default: bf16)")
    engine.add_argument("--expert-group-size", type=int, choices=[32, 64, 128], default=None, metavar="32|64|128",
                        help="int4's group size (default: 128)")
    engine.add_argument("--dtype", choices=DTYPES, default="auto", metavar="|".join(DTYPES),
                        help="the other weights' dtype (default: auto, the checkpoint's)")
    engine.add_argument("--device", default="auto", help="where the other weights compute: cpu, cuda, cuda:1 "
                        "(default: auto, cuda where there is one)")
    engine.add_argument("--cpu-threads", type=_positive_int, default=None, metavar="N",
                        help="the expert engine's threads per layer (default: every CPU this process may use)")


def run(args: argparse.Namespace) -> int:
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        print(MISSING_DEPENDENCIES, file=sys.stderr)
        return 2
    from hybridmoe.hf.finetune import FinetuneOptions, finetune
    from hybridmoe.hf.training import TrainPlan

    plan = TrainPlan(lr=args.lr, epochs=args.epochs, max_steps=args.max_steps, batch_size=args.batch_size,
                     grad_accum=args.grad_accum, max_grad_norm=args.max_grad_norm, save_every=args.save_every,
                     seed=args.seed)
    options = FinetuneOptions(Path(args.model), Path(args.data), Path(args.out), args.lora_rank, args.lora_alpha,
                              args.lora_targets, plan, args.max_length, args.expert_format, args.expert_group_size,
                              args.dtype, args.device, args.cpu_threads, args.resume)
    result = finetune(options, show=lambda line: print(line, file=sys.stderr))
    final = f", last step's loss {result.losses[-1]:.4f}" if result.losses else ""
    print(f"wrote the LoRA adapter to {result.adapter_dir} ({len(result.losses)} steps run{final})", file=sys.stderr)
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
