"""The issue's preset runs of `e2e.py run`: a synthetic model, its depths, formats, prompt lengths, ablation
rows and GPU budget, each option given on the command line taking the suite's place.

    python3 benchmarks/e2e.py suite qwen3 | dsv2lite | dsv3 [any option of `e2e.py run` but the model]

qwen3: Qwen3-30B-A3B cut to 4 and 12 layers (fitted to 48), int4 and bf16, prompts of 512, 2048 and 8192
tokens, 64 decoded, the ablation rows graph, trim, pin, help, ahead, deferral (1 and 2), gpu-experts and
packed, 3 interleaved repeats, 16 GiB of GPU memory; dsv2lite: DeepSeek-V2-Lite cut to 8 layers, int4,
the same prompts, 32 decoded; dsv3: DeepSeek-V3 cut to 2 layers, int4, prompts of 512 and 2048, 16
decoded; both under 16 GiB.
"""

from __future__ import annotations

from . import e2e

SUITES = {
    "qwen3": dict(synthetic="qwen3-30b-a3b", layers="4,12", formats="int4,bf16", prompt_lens="512,2048,8192",
                  gen_len=64, ablation="graph,trim,pin,help,ahead,deferral,gpu-experts,packed", repeats=3,
                  deferral_rows="1,2", engine=dict(gpu_memory_budget="16GiB")),
    "dsv2lite": dict(synthetic="deepseek-v2-lite", layers="8", formats="int4", prompt_lens="512,2048,8192",
                     gen_len=32, ablation=None, engine=dict(gpu_memory_budget="16GiB")),
    "dsv3": dict(synthetic="deepseek-v3", layers="2", formats="int4", prompt_lens="512,2048", gen_len=16,
                 ablation=None, engine=dict(gpu_memory_budget="16GiB")),
}


def add_arguments(parser) -> None:
    parser.add_argument("suite", choices=sorted(SUITES), help="the issue's preset run (see above)")
    e2e.add_arguments(parser, source=False)


def fill(args):
    """args with the suite's settings where the command line left them out (its model: the suite's)."""
    args.model = args.synthetic = None
    return e2e.fill_defaults(args, SUITES[args.suite])


def run(args) -> int:
    return e2e.measure(fill(args))
