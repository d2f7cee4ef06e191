"""`hybridmoe doctor [--model DIR] [--prompt-len N] [--json FILE] [engine options]`: what this machine is, and
what a run would choose.

Prints the CPU's ISA, cores, NUMA nodes, RAM and GPU; measures host read bandwidth (and, with a GPU, its memory
bandwidth and pinned host-to-GPU bandwidth); for a model, the choices `run`/`chat`/`serve`/`bench` would make
with the same options (system/auto.py), the expert placement, what one decode token reads on each device and
the decode speed those reads allow at the measured bandwidths, and which device bounds it
(system/decode_estimate.py). On the CPU device nothing is placed on a GPU, and the flags given that only act
on a GPU are named (a split that run would refuse there is refused all the same). --json FILE also writes the
findings (the estimate at estimate.decode_tok_s, the field `bench --json` writes as result.decode_tok_s). Reads
no weights.

Here too: the lines run, chat, serve and bench print before their output (engine_lines, print_choices).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace

from hybridmoe.commands.engine_args import add_engine_arguments, engine_kwargs
from hybridmoe.errors import HybridMoEError

RANDOM_WEIGHTS_LINE = ("weights:    random (a `hybridmoe make-model` checkpoint): the text it writes is noise; "
                       "speed and memory are real")

GPU_FLAGS = ("gpu_memory_budget", "gpu_experts_per_layer", "gpu_experts_packed", "expert_placement", "expert_stats",
             "deferred_experts", "cuda_graph", "prefill_streaming", "prefill_streaming_tokens")
"""Engine options that place or run something on a GPU: on the CPU device they change nothing doctor plans."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="DIR", help="a model directory to plan for (only config.json is read)")
    parser.add_argument("--measure-bytes", default="1GiB", metavar="SIZE",
                        help="buffer the host read bandwidths are measured over (default: 1GiB; PCIe: the "
                             "256 MiB copy the streaming choice measures)")
    parser.add_argument("--prompt-len", type=int, default=128, metavar="N",
                        help="tokens in the KV cache the decode estimate assumes (default: 128, as bench's)")
    parser.add_argument("--json", metavar="FILE", help="also write the findings here")
    add_engine_arguments(parser)


_ISA_GROUPS = (("AMX", (("amx_tile", "TILE"), ("amx_bf16", "BF16"), ("amx_int8", "INT8"))),
               ("AVX-512", (("avx512f", "F"), ("avx512_bf16", "BF16"), ("avx512_vnni", "VNNI"),
                            ("avx512_fp16", "FP16"))),
               ("AVX2", (("avx2", ""),)))


def isa_line(isa: dict | None) -> str:
    """"AMX no; AVX-512 yes (F, BF16, VNNI); AVX2 yes" from the native engine's cpuid flags."""
    if isa is None:
        return "unknown (the native engine is not built)"
    parts = []
    for name, flags in _ISA_GROUPS:
        have = [label for flag, label in flags if isa.get(flag)]
        detail = f" ({', '.join(h for h in have if h)})" if any(have) else ""
        parts.append(f"{name} {'yes' + detail if have else 'no'}")
    return "; ".join(parts)


def run(args: argparse.Namespace) -> int:
    from hybridmoe.config import EngineConfig, format_bytes, parse_bytes
    from hybridmoe.system.auto import PCIE_MEASURE_BYTES, measured_pcie_bandwidth
    from hybridmoe.system.bandwidth import device_copy_bandwidth, floor_bandwidth, floor_bandwidth_method
    from hybridmoe.system.host import host_info

    if args.prompt_len < 1:
        raise HybridMoEError(f"--prompt-len must be at least 1, got {args.prompt_len}")
    measure = parse_bytes(args.measure_bytes)
    given = engine_kwargs(args)
    engine_config = EngineConfig.from_kwargs(**given)
    host = host_info()
    print(f"cpu:        {host.cpu_model}")
    print(f"isa:        {isa_line(host.isa)}; kernel paths: {', '.join(host.kernel_paths) or 'none'}")
    print(f"cores:      {host.allowed_cpus} usable of {host.online_cpus} online"
          f"{f' ({host.physical_cores} physical)' if host.physical_cores else ''}; NUMA nodes: {host.numa_nodes}")
    print(f"ram:        {format_bytes(host.ram_total_bytes)} total, {format_bytes(host.ram_available_bytes)} available")
    for i, g in enumerate(host.gpus):
        print(f"gpu {i}:      {g.name}, {format_bytes(g.total_bytes)} total, {format_bytes(g.free_bytes)} free")
    if not host.gpus:
        print("gpu:        none (torch sees no CUDA device): everything runs on the CPU")
    measured = {"host_read_bytes_s": floor_bandwidth(measure, engine_config.cpu_threads),
                "host_read_method": floor_bandwidth_method(), "measure_bytes": measure}
    print(f"host read:  {measured['host_read_bytes_s'] / 1e9:.1f} GB/s ({floor_bandwidth_method()} over "
          f"{format_bytes(measure)}, {engine_config.cpu_threads or host.allowed_cpus} threads)")
    if host.gpus:
        gpu = engine_config.device if engine_config.device.startswith("cuda") else "cuda"
        measured["gpu_copy_bytes_s"] = device_copy_bandwidth(gpu, PCIE_MEASURE_BYTES)
        measured["pcie_h2d_bytes_s"] = measured_pcie_bandwidth(gpu)
        print(f"gpu read:   {measured['gpu_copy_bytes_s'] / 1e9:.1f} GB/s (device copy of "
              f"{format_bytes(PCIE_MEASURE_BYTES)}, read and write counted)")
        print(f"pcie h2d:   {measured['pcie_h2d_bytes_s'] / 1e9:.1f} GB/s (pinned, {format_bytes(PCIE_MEASURE_BYTES)})")
    findings = {"host": asdict(host), "bandwidth": measured}
    if args.model:
        lines, found = model_report(args.model, engine_config, measured, args.prompt_len, set(given))
        for line in lines:
            print(line)
        findings.update(found)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(findings, f, indent=2, default=str)
    return 0


def choices_line(ec, cuda_graph: bool | None = None) -> str:
    """What "auto" became in the resolved EngineConfig ec; cuda_graph: whether decode replays CUDA graphs
    (known once an engine is built; None leaves it out)."""
    from hybridmoe.config import format_bytes

    graph = "" if cuda_graph is None else f", cuda_graph {'on' if cuda_graph else 'off'}"
    tokens = ec.prefill_streaming_tokens if ec.prefill_streaming == "on" else None  # None: measured at load
    return (f"choices:    device {ec.device}, expert_backend {ec.expert_backend}"
            f"{f' ({ec.expert_format})' if ec.expert_backend == 'native' else ''}, gpu_memory_budget "
            f"{format_bytes(ec.gpu_memory_budget) if ec.gpu_memory_budget is not None else 'none'}, "
            f"deferred_experts {ec.deferred_experts}, prefill_streaming {ec.prefill_streaming}"
            f"{f' ({tokens}+ tokens)' if tokens else ''}{graph}")


def engine_lines(ec, cuda_graph: bool | None = None, random_weights: bool = False) -> list[str]:
    """What run, chat, serve, bench (and doctor for a model) print before their output: the choices line, then
    RANDOM_WEIGHTS_LINE when the checkpoint's weights are random (make-model's mark in config.json)."""
    return [choices_line(ec, cuda_graph), *([RANDOM_WEIGHTS_LINE] if random_weights else [])]


def print_choices(engine) -> None:
    """engine_lines of a loaded LLMEngine, to stderr: what run/chat/serve chose (their stdout is the text)."""
    for line in [*engine_lines(engine.resolved_config, engine.runner.cuda_graph, engine.random_weights),
                 f"kv cache:   {engine.kv_plan.line()}"]:
        print(line, file=sys.stderr, flush=True)


def model_report(model_dir: str, engine_config, measured: dict, prompt_len: int,
                 given: set[str]) -> tuple[list[str], dict]:
    """What a run of model_dir with engine_config would choose and place, and its decode estimate: doctor's
    lines and findings. measured: the bandwidths run() measured; given: the engine options on the command line."""
    import torch

    from hybridmoe.checkpoint.make import RANDOM_WEIGHTS_KEY
    from hybridmoe.config import format_bytes, uses_hybrid
    from hybridmoe.experts.placement import placement_for
    from hybridmoe.models.registry import load_config
    from hybridmoe.system.auto import resolve_engine_config
    from hybridmoe.system.bandwidth import torch_gemv_bandwidth
    from hybridmoe.system.decode_estimate import Bandwidths, TokenBytes, estimate_decode, model_token_bytes
    from hybridmoe.weights.gguf_model_dir import resolve_model_path
    from hybridmoe.weights.loader import resolve_dtype

    model_dir = resolve_model_path(model_dir, engine_config)
    cls, config = load_config(model_dir)
    dtype = resolve_dtype(engine_config.dtype, config)
    ec = resolve_engine_config(engine_config, config, dtype, model_dir)
    on_gpu = torch.device(ec.device).type == "cuda"
    random_weights = bool(config.get(RANDOM_WEIGHTS_KEY))
    model_line = (f"model:      {config.get('model_type', cls.__name__)}, {config.num_hidden_layers} layers, "
                  f"compute {str(dtype).removeprefix('torch.')}")
    lines = [model_line, *engine_lines(ec, random_weights=random_weights)]
    not_applied = [] if on_gpu else [name for name in GPU_FLAGS if name in given]
    if not_applied:
        flags = ", ".join("--" + name.replace("_", "-") for name in not_applied)
        lines.append(f"no GPU:     {flags}: device {ec.device} has no GPU to place or run anything on; every "
                     "routed expert runs on the CPU")
    if not on_gpu and uses_hybrid(ec):
        placement_for(cls, config, dtype, ec)  # run splits the experts on the CPU all the same: what it refuses
    planned = ec if on_gpu else replace(ec, gpu_memory_budget=None, gpu_experts_per_layer=None, deferred_experts=0)
    place_lines, routed, placed = _placement(cls, config, dtype, planned, engine_config)
    lines += place_lines
    torch_read = torch_gemv_bandwidth(measured["measure_bytes"], dtype)
    lines.append(f"torch read: {torch_read / 1e9:.1f} GB/s ({str(dtype).removeprefix('torch.')} matrix-vector "
                 f"products over {format_bytes(measured['measure_bytes'])}, {torch.get_num_threads()} threads)")
    bandwidths = Bandwidths(measured["host_read_bytes_s"], torch_read, measured.get("gpu_copy_bytes_s"))
    token = TokenBytes(model_token_bytes(cls, config, dtype, prompt_len), **routed, context=prompt_len)
    estimate = estimate_decode(token, on_gpu, planned.expert_backend == "native", bandwidths)
    lines += estimate.lines()
    findings = {"model": {"dir": str(model_dir), "model_type": config.get("model_type"),
                          "layers": config.num_hidden_layers, "dtype": str(dtype).removeprefix("torch."),
                          "random_weights": random_weights},
                "choices": vars(ec), "not_applied": not_applied, "placement": placed, "estimate": estimate.to_json(),
                "bandwidth": {**measured, "torch_read_bytes_s": torch_read}}
    return lines, findings


def _placement(cls, config, dtype, planned, asked) -> tuple[list[str], dict, dict]:
    """The placement, memory and streaming lines for the resolved (and, on the CPU, GPU-less) config planned;
    the routed experts one token reads by where they live (TokenBytes' fields); the placement's findings."""
    from hybridmoe.config import uses_hybrid
    from hybridmoe.experts.expert_bytes import cpu_expert_bytes
    from hybridmoe.experts.placement import model_footprint, placement_for
    from hybridmoe.system.auto import prefill_streaming_decision
    from hybridmoe.system.expert_memory import memory_line

    native = planned.expert_backend == "native"
    if uses_hybrid(planned):
        plan, stats = placement_for(cls, config, dtype, planned)
        fp = plan.footprint
        lines = [f"placement:  {plan.describe()}"]
        on_host = plan.cpu_experts_per_token(stats)
        per_layer_host = [fp.num_experts - len(plan.on_gpu(layer)) for layer in fp.moe_layers]
        with_model_bytes = fp.expert_bytes
    else:
        fp = model_footprint(cls, config, dtype, planned)
        count = f"{fp.num_experts} x {len(fp.moe_layers)} MoE layers"
        where = (f"every routed expert on the CPU ({count}), run by the native engine" if native else
                 f"every routed expert where the model runs, device {planned.device} ({count}), run by torch")
        lines = [f"placement:  {where}"]
        on_host = float(fp.top_k * len(fp.moe_layers)) if native else 0.0
        per_layer_host = [fp.num_experts] * len(fp.moe_layers)
        with_model_bytes = 3 * fp.moe_intermediate_size * fp.hidden_size * dtype.itemsize
    if native:
        lines.append(memory_line(planned, per_layer_host, fp.hidden_size, fp.moe_intermediate_size))
        host_bytes = cpu_expert_bytes(planned.expert_format, fp.moe_intermediate_size, fp.hidden_size,
                                      planned.expert_group_size_or_default)
    else:
        host_bytes = 3 * fp.moe_intermediate_size * fp.hidden_size * dtype.itemsize
    trade = ""
    if planned.device == "cuda" and uses_hybrid(planned):  # the budget's GiB go to context or to experts
        trade = (f"; each GiB of GPU budget holds {(1 << 30) // fp.kv_plan.bytes_per_token} tokens of context or "
                 f"{(1 << 30) // fp.expert_bytes} routed experts (--kv-cache-budget sets the split)")
    lines.append(f"kv cache:   {fp.kv_plan.line()}{trade}")
    streaming = replace(planned, prefill_streaming=asked.prefill_streaming,
                        prefill_streaming_tokens=asked.prefill_streaming_tokens)
    lines.append(f"streaming:  long prefill steps {prefill_streaming_decision(streaming, config, dtype).reason}")
    routed = {"experts_with_model": fp.top_k * len(fp.moe_layers) - on_host,
              "expert_bytes_with_model": with_model_bytes, "experts_on_host": on_host,
              "expert_bytes_on_host": host_bytes}
    placed = {"text": lines[0].removeprefix("placement:  "), "routed_experts": fp.num_experts * len(fp.moe_layers),
              "kv_cache": {"bytes": fp.kv_plan.bytes, "tokens": fp.kv_plan.tokens,
                           "max_model_len": fp.kv_plan.max_model_len,
                           "tokens_per_gib": (1 << 30) // fp.kv_plan.bytes_per_token},
              "routed_experts_on_host": sum(per_layer_host) if native or uses_hybrid(planned) else 0}
    return lines, routed, placed
