"""Where a decode step's time goes outside its layers, and what the runner's host paths cost, side by side.

    python3 benchmarks/decode.py step-parts --synthetic qwen3-30b-a3b --layers 4 --formats int4,bf16
        [--variants old,device,ahead] [--repeats 3] [--runs 1] [--gen-len 64] [--decode-prompt-len 64] [--replays 64]
        [--json F] [engine options: --device cuda --gpu-memory-budget 16GiB --gpu-experts-per-layer 26 ...]

Per engine (a synthetic checkpoint in memory, one expert format), greedy decode at batch 1, with the model
runner's host path of each variant (VARIANTS: ModelRunner.sample_on_device and lookahead), switched on the
same engine and measured `repeats` times interleaved (each round starting one row later):
- us/token: gen_len tokens through LLMEngine.step(), the prompt's step left out (median of the samples, a
  sample the median of `runs` decode runs in a row); "tokens" says whether the variant decoded the first
  variant's tokens; the spread (slowest - fastest) / median over the samples of their i-th runs alone and
  of their medians: whether e2e's samples would scatter less with several runs each.
- host phases (first round, a probed run: perf_counter around the engine's own methods): schedule, the
  runner's step up to the graph launch (input copies, thread pinning), the launch itself, the wait for the
  token, the runner's step after it, postprocess, and what is left of the step. With lookahead the launch
  is the next step's, made before this step's token is waited for.
- GPU (CUDA events around the same calls): the replayed graph's span, the span from its end to the token
  read, and the time between one step's token and the next launch (without lookahead the GPU is idle then:
  the host's serial share of the step).
- "replays": the decode step's CUDA graph (the old variant's) replayed back to back `replays` times with no
  host in the loop: the step as the GPU and the CPU experts alone run it.
- eager parts on the GPU (CUDA events, median of 50): embedding, final norm, lm_head (with its GB/s),
  argmax, the logits' clone and the token's read back.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager, nullcontext

import torch

from hybridmoe.bench.synthetic import synthetic_checkpoint
from hybridmoe.commands.engine_args import add_engine_arguments, engine_kwargs
from hybridmoe.config import EngineConfig
from hybridmoe.engine.llm_engine import LLMEngine

from .cli import str_list, write_json
from .common import decode_seconds

VARIANTS = {"old": dict(sample_on_device=False, lookahead=False),
            "device": dict(sample_on_device=True, lookahead=False),
            "ahead": dict(sample_on_device=True, lookahead=True)}
"""ModelRunner attributes of each variant: old, the sampler on copied-back logits and the inputs copied every
step; device, the step's own argmax read back and inputs left on the device; ahead, also the next step
launched before this one's token is read."""
PHASES = ("schedule", "run_pre", "launch", "wait_token", "run_post", "postprocess", "loop_other")


def add_arguments(parser):
    parser.add_argument("--synthetic", required=True, metavar="PRESET", help="a make-model preset, written to memory")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the cut model (default 4)")
    parser.add_argument("--formats", default=None, help="expert formats, e.g. int4,bf16 (default: the engine's)")
    parser.add_argument("--gen-len", type=int, default=64, help="tokens decoded per timed run (default 64)")
    parser.add_argument("--decode-prompt-len", type=int, default=64)
    parser.add_argument("--variants", default="old,device,ahead", help=f"among {','.join(VARIANTS)} (default all)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds over the variants (default 3)")
    parser.add_argument("--runs", type=int, default=1,
                        help="timed decode runs per sample, the sample their median (default 1); the output gives "
                        "the spread over the samples of each run alone and of the medians")
    parser.add_argument("--replays", type=int, default=64, help="back-to-back graph replays (default 64)")
    parser.add_argument("--seed", type=int, default=0)
    add_engine_arguments(parser)


class StepProbe:
    """Host timestamps and CUDA events around the engine's step methods, wrapped on the instances only."""

    def __init__(self, engine):
        self.engine = engine
        self.marks: list[dict] = []  # one per step: name -> perf_counter
        self.events: list[dict] = []  # one per step: name -> torch.cuda.Event

    def _mark(self, name: str, event: bool = False) -> None:
        self.marks[-1][name] = time.perf_counter()
        if event and torch.cuda.is_available():
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.events[-1][name] = e

    @contextmanager
    def installed(self):
        engine, runner = self.engine, self.engine.runner
        schedule, run, postprocess, sampler = (engine.scheduler.schedule, runner.run, engine._postprocess,
                                               runner.sampler)
        replay = torch.cuda.CUDAGraph.replay

        def schedule_w():
            self.marks.append({"start": time.perf_counter()})
            self.events.append({})
            out = schedule()
            self._mark("scheduled")
            return out

        def run_w(batch, **kwargs):
            self._mark("run_in")
            out = run(batch, **kwargs)
            self._mark("run_out", event=True)
            return out

        def sampler_w(logits, rows):
            out = sampler(logits, rows)
            self._mark("token", event=True)
            return out

        def replay_w(graph):
            self._mark("launch_in", event=True)
            replay(graph)
            self._mark("launch_out", event=True)

        def postprocess_w(*a):
            self._mark("post_in")
            out = postprocess(*a)
            self._mark("post_out")
            return out

        wrapped = [(engine.scheduler, "schedule", schedule_w), (runner, "run", run_w),
                   (engine, "_postprocess", postprocess_w), (runner, "sampler", sampler_w)]
        own = [(obj, name, vars(obj).get(name)) for obj, name, _ in wrapped]  # instance attributes before
        for obj, name, fn in wrapped:
            setattr(obj, name, fn)
        torch.cuda.CUDAGraph.replay = replay_w
        try:
            yield self
        finally:
            torch.cuda.CUDAGraph.replay = replay
            for obj, name, before in own:
                if before is None:
                    delattr(obj, name)
                else:
                    setattr(obj, name, before)

    def summary(self) -> dict:
        """Mean us per decode step of each host phase and GPU span (steps with a graph launch only, the first
        of them left out: its idle time starts at the prompt's step)."""
        for m, e in zip(self.marks, self.events):  # a step whose token the runner read itself: at run's return
            if "token" not in m and "run_out" in m:
                m["token"] = m["run_out"]
                if "run_out" in e:
                    e["token"] = e["run_out"]
        steps = [(m, e) for m, e in zip(self.marks, self.events) if "launch_in" in m and "token" in m]
        host = {k: [] for k in PHASES}
        gpu = {"graph": [], "after_graph": [], "idle_before": []}
        for i, (m, e) in enumerate(steps):
            host["schedule"].append(m["scheduled"] - m["start"])
            host["run_pre"].append(m["launch_in"] - m["run_in"])
            host["launch"].append(m["launch_out"] - m["launch_in"])
            host["wait_token"].append(m["token"] - m["launch_out"])
            host["run_post"].append(m["run_out"] - m["token"])
            host["postprocess"].append(m["post_out"] - m["post_in"])
            if e:
                gpu["graph"].append(e["launch_in"].elapsed_time(e["launch_out"]) / 1e3)
                gpu["after_graph"].append(e["launch_out"].elapsed_time(e["token"]) / 1e3)
            if i:
                if e:
                    gpu["idle_before"].append(steps[i - 1][1]["token"].elapsed_time(e["launch_in"]) / 1e3)
                total = m["start"] - steps[i - 1][0]["start"]
                host["loop_other"].append(total - sum(host[k][i - 1] for k in PHASES[:-1]))
        if not all("launch_in" in e for _, e in steps):
            gpu = {k: [] for k in gpu}  # no CUDA events on this machine
        mean = lambda xs: 1e6 * statistics.fmean(xs) if xs else float("nan")  # noqa: E731
        walls = [b[0]["start"] - a[0]["start"] for a, b in zip(steps, steps[1:])]
        q = statistics.quantiles(walls, n=10, method="inclusive") if len(walls) > 1 else [float("nan")] * 9
        return {"steps": len(steps), "step_us": mean(walls),
                "step_pct_us": {"p10": 1e6 * q[0], "p50": 1e6 * q[4], "p90": 1e6 * q[8],
                                "max": 1e6 * max(walls, default=float("nan"))},
                "host_us": {k: mean(v) for k, v in host.items()},
                "gpu_us": {k: mean(v) for k, v in gpu.items()}}


def replay_loop(engine, replays: int) -> float:
    """Seconds per replay of the engine's most recently captured decode graph, back to back."""
    runner = engine.runner
    if not runner.captured:
        return float("nan")
    graph = runner._graphs[max(runner._graphs)][0]
    decode_thread = getattr(runner.model.experts, "decode_thread", nullcontext)
    with decode_thread():
        graph.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / replays


def gpu_ms(fn, n: int = 50) -> float:
    """Median ms of fn() on the GPU (CUDA events around each call; the wall clock without CUDA)."""
    if not torch.cuda.is_available():
        times = []
        for _ in range(n + 3):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times[3:])
    times = []
    for _ in range(n + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times[3:])


def eager_parts(engine) -> dict:
    model = engine.runner.model
    dev = engine.runner.device
    H = model.lm_head.weight.shape[1]
    ids = torch.zeros(1, dtype=torch.long, device=dev)
    h = torch.randn(1, H, dtype=model.lm_head.weight.dtype, device=dev)
    logits = model.compute_logits(h)
    with torch.inference_mode():
        parts = {"embed": gpu_ms(lambda: model.model.embed_tokens(ids)),
                 "final_norm": gpu_ms(lambda: model.model.norm(h)),
                 "lm_head": gpu_ms(lambda: model.compute_logits(h)),
                 "argmax": gpu_ms(lambda: logits.argmax(dim=-1)),
                 "clone": gpu_ms(lambda: logits.clone()),
                 "argmax_tolist": gpu_ms(lambda: logits.argmax(dim=-1).tolist())}
    w = model.lm_head.weight
    parts["lm_head_gbps"] = w.numel() * w.element_size() / (parts["lm_head"] * 1e-3) / 1e9
    return {k: (1e3 * v if k != "lm_head_gbps" else v) for k, v in parts.items()}  # us, and GB/s


def spread(values: list[float]) -> float:
    """(slowest - fastest) / median, as e2e's repeats table gives it."""
    return (max(values) - min(values)) / statistics.median(values)


def set_variant(engine, name: str) -> None:
    for attr, value in VARIANTS[name].items():
        setattr(engine.runner, attr, value)


def measure(engine, args) -> dict:
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, engine.vocab_size, (args.decode_prompt_len,), generator=g).tolist()
    names = args.variants.split(",")
    samples, tokens, probes = {n: [] for n in names}, {}, {}
    for rep in range(args.repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            set_variant(engine, name)
            decode_seconds(engine, prompt, args.gen_len)  # captures the graphs these lengths replay (again)
            runs = []
            for _ in range(args.runs):
                seconds, tokens[name] = decode_seconds(engine, prompt, args.gen_len)
                runs.append(1e6 * seconds)
            samples[name].append(runs)
            if rep == 0:
                probe = StepProbe(engine)
                with probe.installed():
                    decode_seconds(engine, prompt, args.gen_len)
                probes[name] = probe.summary()
    set_variant(engine, "old")
    decode_seconds(engine, prompt, args.gen_len)
    rows = {n: {"us": statistics.median(map(statistics.median, samples[n])), "samples_us": samples[n],
                "spread_runs": [spread([r[i] for r in samples[n]]) for i in range(args.runs)],
                "spread_median": spread(list(map(statistics.median, samples[n]))),
                "tokens_equal": tokens[n] == tokens[names[0]],
                "probe": probes[n]} for n in names}
    return {"variants": rows, "replay_us": 1e6 * replay_loop(engine, args.replays), "eager_us": eager_parts(engine),
            "graphs": [list(k) for k in engine.runner.captured]}


def run(args) -> int:
    kwargs = engine_kwargs(args)
    results = []
    with synthetic_checkpoint(args.synthetic, args.layers, seed=args.seed) as ckpt:
        for fmt in str_list(args.formats) or [None]:
            ec = EngineConfig.from_kwargs(**dict(kwargs, **({"expert_format": fmt} if fmt else {})))
            engine = LLMEngine(str(ckpt.out_dir), ec)
            r = {"format": fmt, "layers": args.layers, **measure(engine, args)}
            del engine
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            results.append(r)
            print(f"== {fmt} {args.layers} layers, graphs {r['graphs']}; graph replayed back to back: "
                  f"{r['replay_us']:.0f} us/step")
            base = r["variants"][args.variants.split(",")[0]]["us"]
            for name, v in r["variants"].items():
                p = v["probe"]
                print(f"  {name:<7} {v['us']:7.0f} us/token ({base / v['us']:.3f}x the first; replay/this "
                      f"{r['replay_us'] / v['us']:.3f})  tokens {'equal' if v['tokens_equal'] else 'DIFFER'}; "
                      "spread over "
                      f"samples: run 1, 2, ... alone {' '.join(f'{100 * x:.1f}%' for x in v['spread_runs'])}, median "
                      f"of {args.runs} runs {100 * v['spread_median']:.1f}%")
                print("          runs us/token: " + " | ".join(" ".join(f"{x:.0f}" for x in runs)
                                                            for runs in v["samples_us"]))
                print(f"          probed step us: mean {p['step_us']:.0f}, "
                      + ", ".join(f"{k} {x:.0f}" for k, x in p["step_pct_us"].items()))
                print("          host us/step: " + ", ".join(f"{k} {x:.1f}" for k, x in p["host_us"].items()))
                print("          GPU us/step:  " + ", ".join(f"{k} {x:.1f}" for k, x in p["gpu_us"].items()))
            print("  eager GPU us: " + ", ".join(f"{k} {v:.1f}" for k, v in r["eager_us"].items()))
    write_json(args.json, results)
    return 0
