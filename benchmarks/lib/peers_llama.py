"""llama.cpp against our engine on the same GGUF file, and against ours from safetensors, at the same shapes,
threads, prompt and generation lengths and GPU share of the routed experts, side by side in one run.

    python3 benchmarks/peers.py llama [--model qwen3-30b-a3b] [--layers 8] [--quants Q4_K_M,Q8_0]
        [--formats int4,int8,bf16] [--shares cpu,16GiB] [--prompt-lens 512,8192] [--gen-len 64] [--reps 3]
        [--threads N] [--device cuda|cpu] [--work-dir /tmp/peers-models] [--build-dir ...] [--json F]

1. A random-weight F16 GGUF of the make-model preset (qwen3-30b-a3b, deepseek-v2-lite, or ARCH:tiny) cut to
   --layers, and llama-quantize's copy in each of --quants (peers_gguf.py; files in --work-dir, reused when
   there). llama.cpp is built first if --build-dir has no binaries (peers_build.py).
2. Per share and quant: our engine on that file with its GPU experts per MoE layer (cpu: none; a budget such as
   16GiB: what the full-depth model gets under it, as benchmarks/e2e.py gives a cut model), then llama-bench
   -ngl 99 on the same file with the -ncmoe that gives the nearest GPU share (peers_share.py).
3. Per share and format: our engine on make-model's safetensors checkpoint of the same shapes (in memory),
   its experts packed to the format, set against the llama.cpp quant nearest in precision.

Our figures come from the e2e benchmark's own measurement (hybridmoe.bench.suite.run_suite, batch 1): each
prompt length prefilled into an empty context, --gen-len tokens decoded after a one-token prompt, --reps
repetitions after one more left out (llama-bench warms each test up with one run of it); llama-bench's pp<N>
and tg<N> are the same work. Each figure is the mean tok/s of the repetitions ± their standard deviation
(llama-bench's avg_ts and stddev_ts); the ratio is ours / llama.cpp. The floors (decode) are each system's
CPU-resident routed-expert bytes read per token at the host read bandwidth measured in this run, as tok/s: ours
from the loaded placement (the routing's GPU share measured over the decode), llama.cpp's from the file's expert
tensors below -ncmoe. A configuration that fails is noted and the others run; a SIGTERM (e.g. `timeout`) prints
what was measured.
"""

from __future__ import annotations

import dataclasses
import math
import time
import traceback
from contextlib import nullcontext
from pathlib import Path

import torch

from hybridmoe.bench.suite import run_suite
from hybridmoe.bench.synthetic import full_config, synthetic_checkpoint
from hybridmoe.config import EngineConfig
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.cpu_experts import default_threads
from hybridmoe.system.bandwidth import floor_bandwidth, floor_bandwidth_method
from hybridmoe.weights.gguf_model_dir import resolve_model_path

from .cli import Stopped, int_list, str_list, write_json
from .peers_build import add_build_arguments, build, provenance
from .peers_compare import comparison_lines, llama_figures, llama_floor_tok_s, our_figures
from .peers_gguf import preset_config, quantize, write_random_gguf
from .peers_llama_bench import llama_bench_command, run_llama_bench
from .peers_report import context, context_lines
from .peers_share import gguf_expert_bytes, llama_gpu_share, ncmoe_for_share, our_gpu_experts

QUANT_RANK = {"Q4_K_M": 0, "Q8_0": 1, "F16": 2}
FORMAT_RANK = {"int4": 0, "int8": 1, "bf16": 2}


def add_arguments(parser) -> None:
    parser.add_argument("--model", default="qwen3-30b-a3b",
                        help="make-model preset: qwen3-30b-a3b, deepseek-v2-lite, qwen3_moe:tiny, deepseek_v2:tiny")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers of the cut model (default 8)")
    parser.add_argument("--quants", default="Q4_K_M,Q8_0", help=f"GGUF types, of {', '.join(QUANT_RANK)}")
    parser.add_argument("--formats", default="int4,int8,bf16", help="our formats from safetensors ('' for none)")
    parser.add_argument("--shares", default=None,
                        help="GPU shares: cpu (every routed expert on the CPU) and GPU budgets such as 16GiB "
                             "(default: cpu,16GiB on CUDA, cpu on the CPU)")
    parser.add_argument("--prompt-lens", default="512,8192")
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each test, both systems (default 3)")
    parser.add_argument("--threads", type=int, help="CPU threads of both (default: every CPU this process may use)")
    parser.add_argument("--device", default=None, help="our device (default cuda when there is one, else cpu)")
    parser.add_argument("--work-dir", default="/tmp/peers-models", help="GGUF files and our packed-expert cache")
    parser.add_argument("--group-size", type=int, help="our int4 group size from safetensors (default: the engine's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bandwidth-bytes", type=int, default=2 << 30, help="host read probe buffer (default 2 GiB)")
    add_build_arguments(parser)


def gguf_files(args, config: dict, quantizer: str, threads: int) -> dict[str, Path]:
    """The F16 GGUF and each quant's (written unless already in --work-dir)."""
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    stem = f"{args.model.replace(':', '-')}-{config['num_hidden_layers']}L-seed{args.seed}"
    f16 = work / f"{stem}-F16.gguf"
    if not f16.is_file():
        partial = f16.with_suffix(".partial")
        done = write_random_gguf(config, partial, seed=args.seed)
        partial.rename(f16)
        print(f"{f16}: {done['bytes'] / 1e9:.2f} GB of random F16 weights ({done['device']}) in "
              f"{done['seconds']:.0f} s", flush=True)
    files = {}
    for quant in str_list(args.quants):
        if quant not in QUANT_RANK:
            raise HybridMoEError(f"--quants takes {', '.join(QUANT_RANK)}, got {quant}")
        path = f16 if quant == "F16" else work / f"{stem}-{quant}.gguf"
        if not path.is_file():
            partial = path.with_suffix(".partial")
            done = quantize(quantizer, f16, partial, quant, threads)
            partial.rename(path)
            print(f"{path}: {done['bytes'] / 1e9:.2f} GB, quantized in {done['seconds']:.0f} s", flush=True)
        files[quant] = path
    return files


class Run:
    """What every measurement of one `llama` run shares, and the comparisons made so far."""

    def __init__(self, args, bench_binary: str, raw_full: dict, config: dict):
        self.args, self.bench_binary, self.raw_full, self.config = args, bench_binary, raw_full, config
        self.threads = args.threads or default_threads()
        self.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.prompt_lens = int_list(args.prompt_lens)
        self.kwargs = dict(device=self.device, cpu_threads=self.threads, max_num_seqs=1,
                           max_model_len=max(self.prompt_lens) + args.gen_len + 8)
        dense = set(range(config.get("first_k_dense_replace", 0))) | set(config.get("mlp_only_layers", []))
        self.moe_layers = [i for i in range(config["num_hidden_layers"]) if i not in dense]
        self.experts = config.get("num_experts") or config["n_routed_experts"]
        self.method = floor_bandwidth_method()
        self.probes = [floor_bandwidth(args.bandwidth_bytes, self.threads)]
        self.comparisons: list[dict] = []
        self.notes: list[str] = []

    def probe(self) -> float:
        """A new host read probe; the higher of it and the one before (a configuration's bandwidth)."""
        self.probes.append(floor_bandwidth(self.args.bandwidth_bytes, self.threads))
        return max(self.probes[-2:])

    def ours(self, system: str, model: str, model_dir: str, share: str, extra: dict):
        """Our engine on model (a .gguf or a directory) at share: its Figures and its SuiteResult's JSON."""
        kwargs = dict(self.kwargs, **extra)
        per_layer, note = our_gpu_experts(share, self.raw_full, kwargs, model_dir)
        budget = {} if share == "cpu" else {"gpu_memory_budget": share}  # the load checks that the experts fit it
        ec = EngineConfig.from_kwargs(**kwargs, **budget, gpu_experts_per_layer=per_layer)
        (result,) = run_suite(system, model, ec, self.prompt_lens, self.args.gen_len, self.probes[-1], self.method,
                              decode_prompt_len=1, seed=self.args.seed, repeats=self.args.reps + 1)
        bandwidth = self.probe()
        floor = dataclasses.replace(result.floor, bandwidth=bandwidth)
        figures = our_figures(system, result, self.args.gen_len, 1.0 / floor.seconds if floor.seconds else math.nan,
                              per_layer / self.experts, f"{per_layer} GPU experts per MoE layer: {note}")
        return figures, result.to_json()

    def llama(self, quant: str, path: Path, gpu_share: float):
        """llama-bench on path with the -ncmoe nearest gpu_share: its Figures and its rows."""
        ncmoe = ncmoe_for_share(self.config["num_hidden_layers"], self.moe_layers, gpu_share)
        exps = gguf_expert_bytes(str(path))
        cmd = llama_bench_command(self.bench_binary, str(path), self.threads, self.prompt_lens, self.args.gen_len,
                                  self.args.reps, ncmoe)
        rows = run_llama_bench(cmd)
        bandwidth = self.probe()
        floor = llama_floor_tok_s(exps, ncmoe, self.experts, self.config["num_experts_per_tok"], bandwidth)
        return llama_figures(f"llama.cpp {quant}", rows, floor, llama_gpu_share(exps, ncmoe), ncmoe), rows

    def compare(self, title: str, llama: tuple, ours: tuple) -> None:
        """A comparison of llama's (Figures, llama-bench rows) and ours' (Figures, SuiteResult JSON), printed."""
        (theirs, bench_rows), (mine, result) = llama, ours
        self.comparisons.append({"title": title, "theirs": theirs, "ours": mine, "ours_result": result,
                                 "llama_bench": [dataclasses.asdict(row) for row in bench_rows]})
        print("\n".join(comparison_lines(title, theirs, mine)), flush=True)


def share_label(share: str) -> str:
    return "every routed expert on the CPU" if share == "cpu" else f"GPU budget {share} (full-depth placement)"


def attempt(r: Run, what: str, fn):
    """fn()'s value, or None with a note (and the traceback on stderr) when it fails: one configuration's failure
    must not lose the others' rows."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        r.notes.append(f"{what}: FAILED ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})")
        print(f"# {r.notes[-1]}", flush=True)
        return None


def measure_all(r: Run, files: dict[str, Path], shares: list[str], formats: list[str], synth) -> None:
    """Every comparison of the run, appended to r.comparisons as it is measured."""
    cache = str(Path(r.args.work_dir) / "cache")
    group = {"expert_group_size": r.args.group_size} if r.args.group_size else {}
    for share in shares:
        llama_of: dict[str, tuple] = {}
        for quant, path in files.items():
            model_dir = str(resolve_model_path(path, EngineConfig(cache_dir=cache)))
            ours = attempt(r, f"ours on the {quant} file at {share}",
                           lambda: r.ours(f"ours ({quant} file)", str(path), model_dir, share, {"cache_dir": cache}))
            if ours is None:
                continue
            theirs = attempt(r, f"llama.cpp {quant} at {share}", lambda: r.llama(quant, path, ours[0].gpu_share))
            if theirs is None:
                continue
            llama_of[quant] = theirs
            r.compare(f"{share_label(share)}: llama.cpp vs ours, the same {quant} file", theirs, ours)
        for name in formats if llama_of else ():
            quant = min(llama_of, key=lambda q: (abs(QUANT_RANK[q] - FORMAT_RANK[name]), -QUANT_RANK[q]))
            extra = {"expert_format": name, "cache_dir": "", **(group if name == "int4" else {})}
            ours = attempt(r, f"ours from safetensors in {name} at {share}",
                           lambda: r.ours(f"ours ({name} safetensors)", str(synth.out_dir), str(synth.out_dir), share,
                                          extra))
            if ours is not None:
                r.compare(f"{share_label(share)}: llama.cpp {quant} vs ours from safetensors in {name}",
                          llama_of[quant], ours)


def run(args) -> int:
    formats = str_list(args.formats)
    unknown = [f for f in formats if f not in FORMAT_RANK]
    if unknown:
        raise HybridMoEError(f"--formats takes {', '.join(FORMAT_RANK)}, got {', '.join(unknown)}")
    ctx = context()
    bins = build(args.source, args.build_dir, args.jobs, args.cpu_only)["binaries"]
    config = preset_config(args.model, args.layers)
    r = Run(args, bins["llama-bench"], full_config(args.model), config)
    shares = str_list(args.shares) if args.shares else (["cpu", "16GiB"] if r.device.startswith("cuda") else ["cpu"])
    if not r.device.startswith("cuda") and shares != ["cpu"]:
        raise HybridMoEError(f"--shares {','.join(shares)} needs a GPU; on {r.device} every expert is on the CPU")
    start = time.perf_counter()
    files = gguf_files(args, config, bins["llama-quantize"], r.threads)
    checkpoint = synthetic_checkpoint(args.model, args.layers, seed=args.seed) if formats else nullcontext(None)
    try:
        with checkpoint as synth:
            measure_all(r, files, shares, formats, synth)
    except Stopped:
        r.notes.append("stopped by SIGTERM (time limit): later comparisons not run")
    source = provenance(args.source)
    lines = [*context_lines(ctx),
             f"# llama.cpp {source.get('llama_cpp_commit') or 'of unknown commit'}, from "
             f"{source.get('sdist') or args.source}, built in {args.build_dir}",
             f"# {args.model} cut to {config['num_hidden_layers']} layers ({len(r.moe_layers)} MoE), batch 1, "
             f"{r.threads} threads each, our device {r.device}; host read bandwidth "
             f"{', '.join(f'{b / 1e9:.1f}' for b in r.probes)} GB/s ({r.method}), each row's floor at the higher of "
             f"the probes around it; {time.perf_counter() - start:.0f} s", *[f"# {n}" for n in r.notes], ""]
    for c in r.comparisons:
        lines += comparison_lines(c["title"], c["theirs"], c["ours"])
    print("\n" + "\n".join(lines))
    write_json(args.json, {"context": ctx, "llama_cpp": source, "model": args.model, "config": config,
                           "threads": r.threads, "device": r.device, "files": {q: str(p) for q, p in files.items()},
                           "bandwidth_probes_gbps": [b / 1e9 for b in r.probes], "notes": r.notes,
                           "comparisons": [dict(c, theirs=c["theirs"].to_json(), ours=c["ours"].to_json())
                                           for c in r.comparisons]})
    return 0
