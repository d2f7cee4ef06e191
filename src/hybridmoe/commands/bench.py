"""`hybridmoe bench --model DIR [--prompt-len N] [--gen-len N] [--batch N] [--seed S] [--json F]`:
end-to-end speed of one model with the same engine options (and automatic choices) as `run`.

Prints the choices the engine made (doctor's lines: plus whether decode replayed CUDA graphs, and whether the
weights are random) and a table: prefill and decode tokens/s, time to first token, load time, peak RSS
(hybridmoe/bench/e2e.py).
"""

from __future__ import annotations

import argparse

from hybridmoe.commands.engine_args import add_engine_arguments, engine_kwargs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR", help="a Hugging Face model directory")
    parser.add_argument("--prompt-len", type=int, default=128, metavar="N", help="prompt tokens per request (default: 128)")
    parser.add_argument("--gen-len", type=int, default=32, metavar="N", help="tokens generated per request (default: 32)")
    parser.add_argument("--batch", type=int, default=1, metavar="N", help="requests sent at once (default: 1)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the random prompts (default: 0)")
    parser.add_argument("--json", metavar="FILE", help="also write the setup and results here")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import json

    from hybridmoe.bench.e2e import Workload, format_table, run_e2e
    from hybridmoe.checkpoint.make import RANDOM_WEIGHTS_KEY
    from hybridmoe.commands.doctor import engine_lines
    from hybridmoe.config import EngineConfig
    from hybridmoe.models.registry import load_config
    from hybridmoe.weights.gguf_model_dir import resolve_model_path

    workload = Workload(args.prompt_len, args.gen_len, args.batch, args.seed)
    engine_config = EngineConfig.from_kwargs(**engine_kwargs(args))
    result = run_e2e(args.model, engine_config, workload)
    _, config = load_config(resolve_model_path(args.model, engine_config))  # the run resolved the path already
    random_weights = bool(config.get(RANDOM_WEIGHTS_KEY))
    for line in engine_lines(result.resolved, result.cuda_graph, random_weights):
        print(line)
    print(format_table(result))
    if args.json:
        data = result.to_json()
        data["setup"]["random_weights"] = random_weights
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2, default=str)
    return 0
