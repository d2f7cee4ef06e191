"""End-to-end speed as issue #4 reports it: prefill tok/s per prompt length, TTFT, decode tok/s, peak GPU
memory, RSS, and the decode floor (CPU-resident expert bytes read per token / host read bandwidth measured
in this run: system.bandwidth.floor_bandwidth, probed before the first configuration and after each, a
row's floor at the higher of the probes around its configuration), at batch 1; one table, and (with
--json) a JSON file that carries the floor.

    python3 benchmarks/e2e.py run --model DIR | --synthetic PRESET [--layers N[,N2,...]]
        [--formats int4,bf16] [--prompt-lens 512,2048,8192] [--gen-len 32] [--ablation [ROWS]] [--repeats N]
        [--decode-runs N] [--deferral-rows 1,2]
        [--json F] [engine options: --device, --gpu-memory-budget, --deferred-experts, ...]
    python3 benchmarks/e2e.py suite qwen3 | dsv2lite | dsv3 [any option above, over the suite's own]

--synthetic writes a random-weight checkpoint of a make-model preset (qwen3-30b-a3b, deepseek-v2-lite,
deepseek-v3, ...) into memory (/dev/shm) and loads it like any directory. Cut to --layers N, it reports
per-layer times and full-depth figures: decode = non-layer part + each layer of the full model at its
kind's measured time (hybridmoe/bench/layers.py, scaled by graph/eager step time); prefill the same way,
from one prefill per prompt length timed per layer. Given two or more depths (--layers 4,16: each built,
loaded, measured and deleted in turn), it also fits decode time per token and each prompt's time to first
token as fixed + per MoE layer x MoE layers over the depths (hybridmoe/bench/fit.py) and reports full depth
from the fit; both kinds of rows say "extrapolated" and from which depths. With a GPU budget, the cut model
holds as many GPU experts per layer as the full-depth model would under the same budget, so its per-layer
figures stand for the full model's.

On CUDA with the stream_mem_ops handoff, every row also says where its decode step's time went
(hybridmoe/bench/anatomy.py): per MoE layer the CPU work, the GPU gap to the next layer's go, how late the
poller saw the go; per token the rest.

--formats runs each expert format in turn, one engine at a time, in this process. --ablation runs each
format "all on" (graphs, GPU experts; deferred experts as given, else 0) and the first format, on the same
model, also with (ROWS, comma-separated, default all): graph: no CUDA graph (the same engine, graphs off);
zero-copy: the same engine with the handoff's rows and output through the device's mapping of the pinned
buffers instead of copies; trim: the same engine with one token's padding slots (weight 0) left out of its
CPU work ("trim padding off", kept in, where the engine already trims, as it does by default); pin: the
same engine with the decode steps' thread left where the scheduler puts it ("unpinned"; by default it runs
off the handoff pool's CPUs, HybridTuning.pin_decode_thread); help: the same engine with the decode steps'
thread spinning in CUDA's wait ("helping wait off"; by default it works in the handoff pool while it waits,
HybridTuning.help_decode_wait); prefetch: the same engine without the next layer's attention and router
weights prefetched into the GPU's L2 while a layer's CPU part runs ("next-layer prefetch off",
HybridTuning.prefetch_next); ahead: the same engine with greedy tokens taken on the GPU and each decode
step launched before the previous token is read ("step ahead", or "step ahead off" where the engine already
does: ModelRunner.sample_on_device and lookahead); these with graphs captured again, on the stream_mem_ops
handoff only, and (without --repeats) followed by "all on" again on the same engine; deferral: deferral
toggled (a row for each K of --deferral-rows K1,K2,... when "all on" has 0, default 1; else one row with 0;
switched on the same engine when it is the hybrid split, as with a GPU budget); gpu-experts: no GPU experts
(--gpu-experts-per-layer 0, a load of its own); packed (int4 / int8): the GPU's experts in the model's dtype
instead of packed as the CPU's (--no-gpu-experts-packed, a load of its own: the budget then holds a quarter
/ half as many). Deferral is not in "all on" by default: it changes the model's output (0 is exact;
`quality.py deferral` gives the cost, `decode.py deferral` the speed side by side).

--repeats N measures the rows of each engine load N times, interleaved (all on, no CUDA graph, deferral,
trim..., all on, no CUDA graph, ...): identical rows can differ between runs, so a row is its median, and a
table lists every sample and the spread; rows of other loads (no GPU experts, other formats) are each
measured N times back to back on their own engine. --decode-runs N times the decode N times in each sample
(after its one untimed run) and takes their median as the sample's. A SIGTERM (e.g. `timeout`) ends the
run with the tables of the configurations measured so far, and the in-memory checkpoint deleted.
Peers (llama.cpp, kt-kernel) are measured side by side on the same host by benchmarks/peers.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import time
import traceback
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridmoe.bench.fit import depth_fits, fit_line
from hybridmoe.bench.floor import ASSUMPTION, floor_ratio
from hybridmoe.bench.suite import DepthInfo, run_suite
from hybridmoe.bench.synthetic import full_config, synthetic_checkpoint
from hybridmoe.commands.engine_args import add_engine_arguments, engine_kwargs
from hybridmoe.config import EngineConfig, uses_hybrid
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.placement import placement_for
from hybridmoe.experts.torch_ref import TorchExperts
from hybridmoe.models.registry import architecture_of, get_model_class
from hybridmoe.system.auto import resolve_engine_config
from hybridmoe.system.bandwidth import floor_bandwidth, floor_bandwidth_method
from hybridmoe.weights.loader import resolve_dtype

from .cli import Stopped, write_json

TARGETS = {"decode_over_floor": 1.15, "prefill2048_over_decode": 10.0}
DEFAULT_DEFERRED = 0
"""Deferred experts of the "all on" rows unless given: 0, exact."""
ABLATION_ROWS = ("graph", "zero-copy", "trim", "pin", "help", "prefetch", "ahead", "deferral", "gpu-experts", "packed")
HANDOFF_ROWS = {"zero-copy": ("zero-copy", {"zero_copy": True}),
                "trim": ("trim padding", {"trim_padding": True}), "pin": ("unpinned", {"pin_decode_thread": False}),
                "help": ("helping wait", {"help_decode_wait": True}),
                "prefetch": ("next-layer prefetch", {"prefetch_next": True}),
                "ahead": ("step ahead", {"sample_on_device": True, "lookahead": True})}
"""Ablation rows measured on the "all on" engine: label suffix and the CudaHandoff options changed
(bench_suite.HANDOFF_OPTIONS, EXPERT_OPTIONS and RUNNER_OPTIONS). After them, "all on" again
with its own options, which shows how much the same engine drifts between its first and last rows."""

DEFAULTS = dict(prompt_lens="512,2048,8192", gen_len=32, repeats=1, deferral_rows="1")
"""What a run takes for the options the command line (and a suite) leave out."""


def add_arguments(parser, source: bool = True) -> None:
    """The options; source: also --model / --synthetic (the suite subcommand names its own model)."""
    if source:
        given = parser.add_mutually_exclusive_group(required=True)
        given.add_argument("--model", metavar="DIR")
        given.add_argument("--synthetic", metavar="PRESET", help="a make-model preset, written to memory")
    parser.add_argument("--layers", help="with --synthetic: decoder layers (default: full depth); two or more "
                        "depths, comma-separated, are each measured and fitted (e.g. 4,16)")
    parser.add_argument("--formats", help="expert formats to run in turn, e.g. int4,bf16 (default: the engine's)")
    parser.add_argument("--prompt-lens", help="prefill prompt lengths (default 512,2048,8192)")
    parser.add_argument("--gen-len", type=int, help="decoded tokens per timed run (default 32)")
    parser.add_argument("--decode-prompt-len", type=int, default=64, help="prompt before the decode run (default 64)")
    parser.add_argument("--prompt-len", type=int, metavar="N",
                        help="one length for both: --prompt-lens N --decode-prompt-len N")
    parser.add_argument("--ablation", nargs="?", const=",".join(ABLATION_ROWS), metavar="ROWS",
                        help=f"also these rows (default all: {','.join(ABLATION_ROWS)}; see above)")
    parser.add_argument("--decode-runs", type=int, default=1,
                        help="timed decode runs of gen_len tokens in each sample, the sample their median (default 1)")
    parser.add_argument("--deferral-rows", metavar="KS",
                        help="deferred experts of the deferral rows when all on has none (default 1; e.g. 1,2)")
    parser.add_argument("--repeats", type=int,
                        help="measure each engine's rows this many times, interleaved, and report the median and "
                             "the spread (default 1)")
    parser.add_argument("--bandwidth-bytes", type=int, default=4 << 30,
                        help="host read probe buffer (default 4 GiB: many times a server's last-level cache, so that "
                             "no pass reads from a cache what the previous one left there)")
    parser.add_argument("--seed", type=int, default=0)
    add_engine_arguments(parser)


def fill_defaults(args, suite: dict | None = None):
    """The suite's settings (options and engine options), then DEFAULTS, for what the command line left out."""
    if args.prompt_len is not None:
        args.prompt_lens, args.decode_prompt_len = str(args.prompt_len), args.prompt_len
    suite = suite or {"engine": {}}
    for key, value in [*suite.items(), *DEFAULTS.items(), *suite["engine"].items()]:
        if key != "engine" and getattr(args, key) is None:
            setattr(args, key, value)
    return args


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",")]
    except ValueError:
        raise HybridMoEError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise HybridMoEError(f"{flag} values must be at least 1, got {text!r}")
    return values


def layer_counts(raw: dict) -> DepthInfo:
    """Decoder, dense and MoE layer counts of a config.json."""
    cls = get_model_class(architecture_of(raw))
    config = cls.make_config(raw)
    with torch.device("meta"):
        model = cls(config, TorchExperts())
    moe = len(model.moe_layers)
    return DepthInfo(config.num_hidden_layers, config.num_hidden_layers - moe, moe)


def full_depth_gpu_experts(raw_full: dict, kwargs: dict, model_dir: str | None = None) -> tuple[int, str]:
    """GPU experts per MoE layer the full-depth model gets under kwargs' budget, and a line saying so.

    model_dir: the cut model, to resolve kwargs' automatic choices as its load will (the expert backend and
    format decide whether the GPU's experts are packed, and so how many fit); None: kwargs as they are."""
    cls = get_model_class(architecture_of(raw_full))
    config = cls.make_config(raw_full)
    ec = EngineConfig.from_kwargs(**{k: v for k, v in kwargs.items() if k != "cache_dir"})
    dtype = resolve_dtype(ec.dtype, config)
    try:
        if model_dir is not None:
            ec = resolve_engine_config(ec, config, dtype, model_dir)
        plan, _ = placement_for(cls, config, dtype, ec)
    except HybridMoEError as e:
        return 0, f"full depth does not fit the budget ({e}); the cut model keeps every routed expert on the CPU"
    per_layer = min((len(plan.on_gpu(layer)) for layer in plan.footprint.moe_layers), default=0)
    return per_layer, (f"full depth under this budget: {plan.describe()}; the cut model gets {per_layer} GPU "
                       "experts per MoE layer to match")


@dataclass(frozen=True)
class Load:
    """One engine load and what is measured on it."""

    label: str
    kwargs: dict
    """Engine options."""
    eager_label: str | None = None
    """Also measure the same engine with graphs off, under this label."""
    handoff_variants: tuple[tuple[str, dict], ...] = ()
    """Also measure the same engine with these (label, CudaHandoff options)."""
    deferral_variants: tuple[tuple[str, int], ...] = ()
    """Also measure the same engine with these (label, deferred experts)."""
    every_length: bool = True
    """Prefill every prompt length (else the first only)."""


def ablation_rows(text: str | None) -> list[str]:
    rows = [r.strip() for r in text.split(",")] if text else []
    unknown = [r for r in rows if r not in ABLATION_ROWS]
    if unknown:
        raise HybridMoEError(f"--ablation takes rows among {','.join(ABLATION_ROWS)}, got {','.join(unknown)}")
    return rows


def handoff_variants(name: str, ablation: list[str], repeats: int = 1) -> tuple[tuple[str, dict], ...]:
    """(label, CudaHandoff options) of the ablation's handoff rows, then "all on" again if there are any
    and no repeats (which show the drift in every row's spread instead)."""
    rows = tuple((f"{name} {HANDOFF_ROWS[row][0]}", HANDOFF_ROWS[row][1]) for row in HANDOFF_ROWS if row in ablation)
    return rows + ((f"{name} all on, again", {}),) if rows and repeats == 1 else rows


def configurations(kwargs: dict, formats: list[str | None], ablation: list[str], repeats: int = 1,
                   deferral_ks: tuple[int, ...] = (1,)) -> list[Load]:
    """Each format; with ablation rows, each format "all on", the first also with graphs off, with deferral
    toggled (to each of deferral_ks, or to 0 where "all on" defers) and with the handoff options (same
    engine), and after every format the first without GPU experts (these prefill the first prompt length
    only), so that a time limit cuts the ablation before a format.
    Deferral is switched on the same engine where it is the hybrid split (HybridExperts), else loaded anew
    after the formats."""
    runs, variants = [], []
    for k, fmt in enumerate(formats):
        base = dict(kwargs, **({"expert_format": fmt} if fmt else {}))
        name = fmt or kwargs.get("expert_format") or "auto format"
        if not ablation:
            runs.append(Load(name, base))
            continue
        base.setdefault("deferred_experts", DEFAULT_DEFERRED)
        first = k == 0
        deferral = ()
        if first and "deferral" in ablation:
            deferral = (tuple((f"{name} deferral {d}", d) for d in deferral_ks) if base["deferred_experts"] == 0
                        else ((f"{name} no deferral", 0),))
            if not uses_hybrid(EngineConfig.from_kwargs(**base)):  # no switch: a load of its own each
                variants += [Load(label, dict(base, deferred_experts=d), every_length=False) for label, d in deferral]
                deferral = ()
        runs.append(Load(f"{name} all on", base,
                         eager_label=f"{name} no CUDA graph" if first and "graph" in ablation else None,
                         handoff_variants=handoff_variants(name, ablation if first else [], repeats),
                         deferral_variants=deferral))
        if first and "gpu-experts" in ablation:
            variants.append(Load(f"{name} no GPU experts", dict(base, gpu_experts_per_layer=0), every_length=False))
        if first and "packed" in ablation and base.get("expert_format") in ("int4", "int8"):
            variants.append(Load(f"{name} GPU experts unpacked", dict(base, gpu_experts_packed=False),
                                 every_length=False))
    return runs + variants


def run_configuration(model_dir: str, load: Load, lens: list[int], **suite) -> list:
    """run_suite for one load; a failure is printed (traceback on stderr) and retried once with prefill
    streaming off, the rows then labelled so; a second failure gives no rows."""
    for extra in ({}, {"prefill_streaming": "off"}):
        if extra and load.kwargs.get("prefill_streaming") == "off":
            break
        tag = " (streaming off)" if extra else ""
        try:
            ec = EngineConfig.from_kwargs(**{**load.kwargs, **extra})
            return run_suite(load.label + tag, model_dir, ec, lens if load.every_length else lens[:1],
                             eager_label=load.eager_label and load.eager_label + tag,
                             handoff_variants=tuple((label + tag, options) for label, options in load.handoff_variants),
                             deferral_variants=tuple((label + tag, k) for label, k in load.deferral_variants),
                             **suite)
        except HybridMoEError:
            raise
        except Exception as e:  # noqa: BLE001 (one configuration's crash must not lose the others' rows)
            traceback.print_exc()
            print(f"  {load.label}{tag}: FAILED ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})",
                  flush=True)
    return []


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def results_table(results, prompt_lens: list[int]) -> list[str]:
    head = (["config", "layers"] + [f"prefill {n}" for n in prompt_lens]
            + [f"TTFT {prompt_lens[0]} ms", "decode tok/s", "ms/token", "floor ms", "decode/floor", "CPU exp/token",
               "GPU exp/layer", "graph", "deferred", "handoff options", "prefill streaming", "peak GPU GiB", "RSS GiB",
               "peak RSS GiB", "load s"])
    rows = []
    for r in results:
        gpu = sorted({layer.on_gpu for layer in r.floor.layers})
        rows.append([r.label, str(r.model_layers)] + [_fmt(r.prefill_tok_s.get(n), ".0f") for n in prompt_lens]
                    + [_fmt(1e3 * r.ttft_s[prompt_lens[0]], ".0f"), _fmt(r.decode_tok_s), _fmt(1e3 * r.decode_s, ".2f"),
                       _fmt(1e3 * r.floor.seconds, ".3f"), _fmt(floor_ratio(r.decode_s, r.floor), ".2f"),
                       _fmt(r.floor.cpu_experts_per_token), "/".join(map(str, gpu)) or "-",
                       "on" if r.cuda_graph else "off", str(r.resolved.deferred_experts),
                       ",".join(k for k, v in (r.handoff_options or {}).items() if v) or "-", _streaming(r.resolved),
                       _fmt(r.peak_gpu_gib, ".2f"), _fmt(r.rss_gib, ".2f"), _fmt(r.peak_rss_gib, ".2f"),
                       _fmt(r.load_s)])
    return _table(head, rows)


def repeats_table(results, prompt_lens: list[int]) -> list[str]:
    """Per row measured more than once: each decode and prefill sample (tok/s, in the order measured,
    interleaved with the engine's other rows), the median and the spread (slowest to fastest / median)."""
    head = ["config", "layers", "n", "decode tok/s median", "decode spread %", "decode tok/s samples"]
    head += [f"prefill {n} samples" for n in prompt_lens]
    rows = []
    for r in results:
        if len(r.decode_samples_s) < 2:
            continue
        prefill = [" ".join(f"{v:.0f}" for v in r.prefill_samples.get(n, [])) or "-" for n in prompt_lens]
        rows.append([r.label, str(r.model_layers), str(len(r.decode_samples_s)), _fmt(r.decode_tok_s),
                     _fmt(100 * r.decode_spread), " ".join(f"{1 / d:.1f}" for d in r.decode_samples_s), *prefill])
    return _table(head, rows) if rows else []


def _streaming(ec) -> str:
    """Whether long prefill steps stream their layers' experts to the device (the engine's own choice)."""
    mode, tokens = ec.prefill_streaming, ec.prefill_streaming_tokens
    return f"on (>= {tokens} tokens)" if mode == "on" and tokens else mode


def anatomy_table(results) -> list[str]:
    """Per row with an anatomy: per MoE layer through the handoff, CPU work (beside its floor), the gap to
    the next layer's go and how late the poller saw it; per token, what the layers leave of the measured step."""
    head = ["config", "layers", "steps", "CPU layers/step", "CPU us/layer", "floor us/layer", "first layer CPU us",
            "gap us/layer", "go late us", "first go late us",
            "layers ms/token", "rest ms/token", "step ms/token"]
    rows = []
    for r in results:
        a = r.anatomy
        if a is None:
            continue
        per_layers = None if a.rest_us is None else a.step_us - a.rest_us
        rows.append([r.label, str(r.model_layers), str(a.steps), _fmt(a.layers_per_step), _fmt(a.cpu_us),
                     _fmt(1e6 * r.floor.per_moe_layer_seconds()), _fmt(a.first_cpu_us), _fmt(a.gap_us), _fmt(a.late_us, ".2f"),
                     _fmt(a.first_late_us, ".2f"),
                     _fmt(None if per_layers is None else per_layers / 1e3, ".3f"),
                     _fmt(None if a.rest_us is None else a.rest_us / 1e3, ".3f"), _fmt(a.step_us / 1e3, ".3f")])
    return _table(head, rows) if rows else []


def full_depth_table(results, prompt_lens: list[int]) -> list[str]:
    """Per cut row: full-depth figures, then its per-layer times (decode eager; each prefill length's MoE
    and dense layer, summed over the prompt's chunks) that the extrapolation is made of."""
    head = (["config (extrapolated)", "from layers", "layers"] + [f"prefill {n}" for n in prompt_lens]
            + ["decode tok/s", "ms/token", "floor ms", "decode/floor", "MoE layer ms (eager)", "floor/MoE layer ms",
               "dense layer ms (eager)", "non-layer ms (eager)"]
            + [f"prefill {n} MoE/dense layer ms" for n in prompt_lens])
    rows = []
    for r in results:
        full = r.full_depth()
        if full is None:
            continue
        lt = r.layer_times
        dense = lt.dense_layer_s
        prefill_layers = []
        for n in prompt_lens:
            p = r.prefill_layer_times.get(n)
            prefill_layers.append("-" if p is None else f"{1e3 * p.mean_s(True):.2f}/" + (
                "-" if p.dense_layer_s is None else f"{1e3 * p.dense_layer_s:.2f}"))
        rows.append([r.label, str(r.model_layers), str(full["layers"])]
                    + [_fmt(full["prefill_tok_s"].get(n), ".0f") for n in prompt_lens]
                    + [_fmt(full["decode_tok_s"]), _fmt(1e3 * full["decode_s"], ".2f"),
                       _fmt(1e3 * full["floor_s"], ".3f"), _fmt(full["decode_over_floor"], ".2f"),
                       _fmt(1e3 * lt.mean_s(True), ".3f"),
                       _fmt(1e3 * r.floor.per_moe_layer_seconds(), ".3f"),
                       _fmt(None if dense is None else 1e3 * dense, ".3f"), _fmt(1e3 * lt.non_layer_s, ".3f")]
                    + prefill_layers)
    return _table(head, rows) if rows else []


def fit_table(fits, prompt_lens: list[int], results) -> list[str]:
    """One row per fit; with repeats, also the decode range at full depth: the slowest and fastest of
    the same fit through every choice of one sample per depth (the medians' fit is one of them)."""
    head = (["config (fit)", "from layers", "layers", "decode fixed ms", "decode ms/MoE layer", "fit max resid ms"]
            + [f"prefill {n}" for n in prompt_lens]
            + ["decode tok/s", "decode tok/s range", "ms/token", "floor ms", "decode/floor", "floor/MoE layer ms"])
    rows = []
    for f in fits:
        prefill = f.prefill_tok_s
        mine = [r for r in results if r.label == f.label and len(r.decode_samples_s) > 1]
        spread = "-"
        if len({r.model_layers for r in mine}) >= 2:  # every choice of one sample per depth, fitted
            at = [fit_line([(len(r.floor.layers), d) for r, d in zip(mine, pick)]).at(f.full_moe_layers)
                  for pick in itertools.product(*(r.decode_samples_s for r in mine))]
            spread = f"{1 / max(at):.1f}-{1 / min(at):.1f}"
        rows.append([f.label, ",".join(map(str, f.depths)), str(f.full_layers), _fmt(1e3 * f.decode.fixed, ".3f"),
                     _fmt(1e3 * f.decode.per_layer, ".3f"), _fmt(1e3 * f.decode.max_residual, ".3f")]
                    + [_fmt(prefill.get(n), ".0f") for n in prompt_lens]
                    + [_fmt(1.0 / f.decode_s), spread, _fmt(1e3 * f.decode_s, ".2f"), _fmt(1e3 * f.floor_s, ".3f"),
                       _fmt(f.decode_over_floor, ".2f"),
                       _fmt(1e3 * f.floor_per_moe_layer_s, ".3f")])
    return _table(head, rows)


def headlines(results, fits) -> list[dict]:
    """Per label, the figures targets are judged on: the depth fit's full depth when there is one, else the
    deepest measurement's own extrapolation when the model was cut, else as measured."""
    fit_of = {f.label: f for f in fits}
    deepest: dict[str, object] = {}
    for r in results:
        if r.label not in deepest or r.model_layers > deepest[r.label].model_layers:
            deepest[r.label] = r
    out = []
    for label, r in deepest.items():
        h = {"label": label, "peak_gpu_gib": r.peak_gpu_gib}
        f, full = fit_of.get(label), r.full_depth()
        if f is not None:
            h.update(prefill_tok_s=f.prefill_tok_s, decode_tok_s=1.0 / f.decode_s,
                     decode_over_floor=f.decode_over_floor,
                     extrapolated=f"extrapolated to {f.full_layers} layers by the fit over "
                                  f"{','.join(map(str, f.depths))} layers")
        elif full:
            h.update(prefill_tok_s=full["prefill_tok_s"], decode_tok_s=full["decode_tok_s"],
                     decode_over_floor=full["decode_over_floor"],
                     extrapolated=f"extrapolated to {full['layers']} layers from {r.model_layers}")
        else:
            h.update(prefill_tok_s=r.prefill_tok_s, decode_tok_s=r.decode_tok_s,
                     decode_over_floor=floor_ratio(r.decode_s, r.floor), extrapolated=None)
        out.append(h)
    return out


def target_lines(final: list[dict], budget: int | None) -> list[str]:
    lines = []
    for h in final:
        if h["peak_gpu_gib"] is not None and budget is not None:
            within = "within" if h["peak_gpu_gib"] * 2**30 <= budget else "OVER"
            lines.append(f"  {h['label']}: peak GPU memory {h['peak_gpu_gib']:.2f} GiB, {within} the budget "
                         f"{budget / 2**30:.2f} GiB")
        p2048 = h["prefill_tok_s"].get(2048)
        p2048 = None if p2048 is not None and math.isnan(p2048) else p2048
        lines.append(f"  {h['label']}: decode/floor {_fmt(h['decode_over_floor'], '.2f')} (target <= "
                     f"{TARGETS['decode_over_floor']})"
                     + (f"; prefill 2048 / decode = {p2048 / h['decode_tok_s']:.1f}x (target >= "
                        f"{TARGETS['prefill2048_over_decode']:.0f}x)" if p2048 else "")
                     + (f" [{h['extrapolated']}]" if h["extrapolated"] else ""))
    return lines


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(c) for c in col) for col in zip(head, *rows)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows]


def run(args) -> int:
    return measure(fill_defaults(args))


def measure(args) -> int:
    """Every configuration of args measured and reported (tables, and the JSON with --json)."""
    prompt_lens = _ints(args.prompt_lens, "--prompt-lens")
    if args.gen_len < 2:
        raise HybridMoEError(f"--gen-len must be at least 2 to time decoding, got {args.gen_len}")
    if args.repeats < 1:
        raise HybridMoEError(f"--repeats must be at least 1, got {args.repeats}")
    formats = [f.strip() for f in args.formats.split(",")] if args.formats else [None]
    ablation = ablation_rows(args.ablation)
    deferral_ks = tuple(_ints(args.deferral_rows, "--deferral-rows"))
    depths = _ints(args.layers, "--layers") if args.layers is not None else [None]
    if depths != [None] and not args.synthetic:
        raise HybridMoEError("--layers cuts a --synthetic model; a --model directory runs at its own depth")
    kwargs = engine_kwargs(args)
    kwargs.setdefault("max_num_seqs", 1)  # batch 1: no KV cache (or graph) for rows never used
    kwargs.setdefault("max_model_len", max(prompt_lens + [args.decode_prompt_len]) + args.gen_len)
    notes = []
    raw_full = None
    if args.synthetic:
        kwargs.setdefault("cache_dir", "")  # a throwaway model: nothing to keep packed on disk
        raw_full = full_config(args.synthetic)
    # a cut model gets the GPU experts per layer of the full-depth plan, load by load (its format decides)
    fit_depth = (raw_full is not None and any(d is not None and d < raw_full["num_hidden_layers"] for d in depths)
                 and kwargs.get("gpu_memory_budget") is not None and "gpu_experts_per_layer" not in kwargs)
    threads = kwargs.get("cpu_threads")
    method = floor_bandwidth_method()
    probes = [floor_bandwidth(args.bandwidth_bytes, threads)]
    print(f"host read bandwidth: {probes[0] / 1e9:.1f} GB/s ({method}, {args.bandwidth_bytes >> 20} MiB, "
          f"{threads or 'all'} threads); probed again after each configuration", flush=True)
    full = layer_counts(raw_full) if raw_full else None
    results, stopped, raw_cut = [], False, {}
    start = time.perf_counter()
    for layers in depths:  # one model in memory at a time
        if stopped:
            break
        source = (synthetic_checkpoint(args.synthetic, layers, seed=args.seed) if args.synthetic
                  else nullcontext(None))
        written = time.perf_counter()
        with source as synthetic:
            model_dir = str(synthetic.out_dir) if synthetic else args.model
            raw_cut = json.loads((Path(model_dir) / "config.json").read_text())
            cut = full is not None and raw_cut["num_hidden_layers"] < full.layers
            depth = full if cut else None  # what a cut model's per-layer figures extrapolate to
            if synthetic:
                print(f"synthetic {args.synthetic}: {raw_cut['num_hidden_layers']} layers, "
                      f"{synthetic.total_bytes / 1e9:.1f} GB written to {synthetic.out_dir} in "
                      f"{time.perf_counter() - written:.1f} s (+{time.perf_counter() - start:.0f} s)", flush=True)
            for load in configurations(kwargs, formats, ablation, args.repeats, deferral_ks):
                if fit_depth and "gpu_experts_per_layer" not in load.kwargs:
                    per_layer, note = full_depth_gpu_experts(raw_full, load.kwargs, model_dir)
                    load = dataclasses.replace(load, kwargs=dict(load.kwargs, gpu_experts_per_layer=per_layer))
                    notes += [] if note in notes else [note]
                try:
                    rows = run_configuration(model_dir, load, prompt_lens, gen_len=args.gen_len,
                                             bandwidth=probes[-1], bandwidth_method=method,
                                             decode_prompt_len=args.decode_prompt_len, seed=args.seed, depth=depth,
                                             repeats=args.repeats, decode_runs=args.decode_runs)
                except Stopped as e:  # the rows of this load measured so far come with it
                    rows = getattr(e, "results", [])
                    notes.append(f"stopped by SIGTERM (time limit) during {load.label} at "
                                 f"{raw_cut['num_hidden_layers']} layers"
                                 f"{' (its rows measured so far are shown)' if rows else ''}: later "
                                 "configurations not run")
                    stopped = True
                probes.append(floor_bandwidth(args.bandwidth_bytes, threads))
                for r in rows:
                    floor_between(r, probes[-2], probes[-1])
                    print(progress_line(r, start), flush=True)
                results += rows
                if stopped:
                    break
    if not results:
        raise HybridMoEError(f"no configuration finished ({'; '.join(notes) or 'tracebacks above'})")
    measured = sorted({r.model_layers for r in results})
    cut = full is not None and measured[0] < full.layers
    fits = depth_fits(results, full.layers, full.moe_layers) if cut else []
    lines = [f"# {args.synthetic or args.model}: {raw_cut.get('model_type')}, "
             f"{' and '.join(map(str, measured))} layers"
             f"{f' (cut from {full.layers})' if cut else ''}, batch 1, device {results[0].resolved.device}, "
             f"budget {kwargs.get('gpu_memory_budget', 'none')}, {torch.get_num_threads()} torch threads",
             f"# floor: CPU-resident expert bytes read per token / the host read bandwidth, the higher of the "
             f"probes just before and just after its configuration ({method}; probes "
             f"{', '.join(f'{b / 1e9:.1f}' for b in probes)} GB/s in order); assumption: {ASSUMPTION}",
             *[f"# {n}" for n in notes], ""]
    lines += results_table(results, prompt_lens)
    repeated = repeats_table(results, prompt_lens)
    if repeated:
        lines += ["", f"# repeats: each engine's rows measured {args.repeats} times, interleaved; the tables show "
                      "medians", *repeated]
    anatomy = anatomy_table(results)
    if anatomy:
        lines += ["", "# where a decode step goes (stream_mem_ops handoff, the polling thread's clock; see "
                      "hybridmoe/bench/anatomy.py): per MoE layer through the handoff, then per token", *anatomy]
    scaled = full_depth_table(results, prompt_lens)
    if scaled:
        lines += ["", f"# extrapolated to {full.layers} layers from each depth alone: decode = non-layer part + "
                      "each layer at its kind's measured time (scaled by graph/eager step time); prefill "
                      "the same, from each prompt's prefill timed per layer", *scaled]
    if fits:
        lines += ["", f"# extrapolated to {full.layers} layers ({full.moe_layers} MoE) by a least-squares fit "
                      f"over the depths measured ({', '.join(map(str, measured))} layers): time = fixed + per MoE "
                      "layer x MoE layers, for decode per token and for each prompt's time to first token",
                  *fit_table(fits, prompt_lens, results)]
    final = headlines(results, fits)
    lines += ["", "# targets (issue #4)", *target_lines(final, results[0].resolved.gpu_memory_budget)]
    print("\n".join(lines))
    setup = {"model": args.model, "synthetic": args.synthetic, "layers": measured,
             "full_layers": full.layers if cut else None, "engine_options": kwargs, "notes": notes,
             "prompt_lens": prompt_lens, "gen_len": args.gen_len, "repeats": args.repeats,
             "decode_runs": args.decode_runs,
             "bandwidth_probes_gbps": [b / 1e9 for b in probes],
             "bandwidth_method": method, "torch": torch.__version__, "targets": TARGETS}
    write_json(args.json, {"setup": setup, "results": [r.to_json() for r in results],
                           "depth_fits": [f.to_json() for f in fits]})
    return 0


def floor_between(r, before: float, after: float) -> None:
    """Row r's floors at the higher of the host read probes taken just before and just after its configuration:
    the probe moves over a run, and a floor from a slower probe is too high (a row may then run faster than its
    floor; docs/decisions.md, "The floor's bandwidth")."""
    bandwidth = max(before, after)
    r.floor = dataclasses.replace(r.floor, bandwidth=bandwidth)
    r.uniform_floor = dataclasses.replace(r.uniform_floor, bandwidth=bandwidth)


def progress_line(r, start: float) -> str:
    prefill = ", ".join(f"{n}: {v:.0f}" for n, v in r.prefill_tok_s.items())
    line = (f"  {r.label} ({r.model_layers} layers): decode {r.decode_tok_s:.1f} tok/s, floor "
            f"{1e3 * r.floor.seconds:.2f} ms (at {r.floor.bandwidth / 1e9:.1f} GB/s), prefill {prefill}"
            f" tok/s, load {r.load_s:.1f} s (+{time.perf_counter() - start:.0f} s)")
    if len(r.decode_samples_s) > 1:
        line += f"\n    decode samples: {' '.join(f'{1 / d:.1f}' for d in r.decode_samples_s)} tok/s"
    a = r.anatomy
    if a is not None:
        line += (f"\n    anatomy: {a.layers_per_step:.0f} MoE layers x (CPU {a.cpu_us:.0f} us + gap {_fmt(a.gap_us, '.0f')}"
                 f" us) + rest {_fmt(a.rest_us, '.0f')} us = {a.step_us:.0f} us/token")
    return line
