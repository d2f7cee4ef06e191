"""End-to-end generation speed of one model directory: prefill and decode tokens/s, time to
first token, load time and peak RSS, as a table and (with --json) a JSON file.

    python benchmarks/e2e.py --model DIR [--prompt-len 128] [--gen-len 32] [--batch 1] [--json F]
                             [engine options: --dtype, --max-num-seqs, --expert-backend, ...]

Prompts are random token ids (any checkpoint works, tokenizer or not); generation is greedy and
ignores EOS, so every request runs exactly --gen-len tokens. All requests arrive at once; a
warm-up request runs first so one-time costs stay out of the numbers.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time

import torch

from hybridmoe.commands.engine_args import add_engine_arguments, engine_kwargs
from hybridmoe.config import EngineConfig
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.sampling_params import SamplingParams


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, metavar="DIR")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1, help="requests sent at once")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    parser.add_argument("--json", metavar="FILE", help="also write the results here")
    add_engine_arguments(parser)
    return parser.parse_args(argv)


def measure(engine: LLMEngine, prompts: list[list[int]], gen_len: int) -> dict:
    params = SamplingParams(max_tokens=gen_len, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    token_times: list[float] = []  # when each generated token arrived
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            first.setdefault(out.request_id, now)
            token_times.append(now)
    end = time.perf_counter()
    prefill_done = max(first[i] for i in ids)
    decoded_after = sum(t > prefill_done for t in token_times)
    ttft = sorted(first[i] - start for i in ids)
    return {
        "prefill_tok_s": sum(map(len, prompts)) / (prefill_done - start),
        "decode_tok_s": decoded_after / (end - prefill_done) if end > prefill_done else float("nan"),
        "ttft_mean_s": sum(ttft) / len(ttft),
        "ttft_max_s": ttft[-1],
        "total_s": end - start,
        "generated_tokens": len(token_times),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    config = EngineConfig.from_kwargs(**engine_kwargs(args))
    t0 = time.perf_counter()
    engine = LLMEngine(args.model, config)
    load_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, engine.vocab_size, (args.batch, args.prompt_len), generator=g).tolist()
    measure(engine, [prompts[0][:8]], 2)  # warm-up
    result = measure(engine, prompts, args.gen_len)
    result["load_s"] = load_s
    result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    setup = {"model": args.model, "architecture": engine.model_config.get("architectures"),
             "dtype": str(engine.dtype).removeprefix("torch."), "prompt_len": args.prompt_len,
             "gen_len": args.gen_len, "batch": args.batch, "engine": vars(config),
             "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine()}
    print_table(setup, result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"setup": setup, "result": result}, f, indent=2, default=str)
    return 0


def print_table(setup: dict, r: dict) -> None:
    print(f"{setup['model']} ({setup['dtype']}, {setup['engine']['expert_backend']} experts, "
          f"{setup['threads']} threads): batch {setup['batch']} x prompt {setup['prompt_len']} "
          f"+ gen {setup['gen_len']}")
    rows = [("prefill", f"{r['prefill_tok_s']:.1f} tok/s"), ("decode", f"{r['decode_tok_s']:.1f} tok/s"),
            ("TTFT mean / max", f"{1000 * r['ttft_mean_s']:.0f} / {1000 * r['ttft_max_s']:.0f} ms"),
            ("load", f"{r['load_s']:.1f} s"), ("peak RSS", f"{r['peak_rss_gib']:.2f} GiB")]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v:>16}")


if __name__ == "__main__":
    sys.exit(main())
