"""End-to-end generation speed of one model directory: prefill and decode tokens/s, time to
first token, load time and peak RSS, as a table and (with --json) a JSON file.

    python benchmarks/e2e.py --model DIR [--prompt-len 128] [--gen-len 32] [--batch 1] [--json F]
                             [engine options: --dtype, --max-num-seqs, --expert-backend, ...]

The measuring is hybridmoe.bench (also `hybridmoe bench`): random prompt ids, greedy generation
that ignores EOS, every request at once after a warm-up request.
"""

from __future__ import annotations

import argparse
import json
import sys

from hybridmoe.bench import Workload, format_table, run_e2e
from hybridmoe.commands.engine_args import add_engine_arguments, engine_kwargs
from hybridmoe.config import EngineConfig


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


def main(argv=None) -> int:
    args = parse_args(argv)
    workload = Workload(args.prompt_len, args.gen_len, args.batch, args.seed)
    result = run_e2e(args.model, EngineConfig.from_kwargs(**engine_kwargs(args)), workload)
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_json(), f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
