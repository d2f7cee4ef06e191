"""`hybridmoe doctor [--model DIR] [engine options]`: what this machine is, and what a run would choose.

Prints the CPU's ISA, cores, NUMA nodes, RAM and GPU; measures host read bandwidth (and pinned
host-to-GPU bandwidth when there is a GPU); for a model, the choices `run`/`chat`/`serve` would make
with the same options (system/auto.py), the expert placement and the expected decode floor:
routed-expert bytes one token reads on the CPU / the measured read bandwidth. Reads no weights.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from hybridmoe.commands.engine_args import add_engine_arguments, engine_kwargs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="DIR", help="a model directory to plan for (only config.json is read)")
    parser.add_argument("--measure-bytes", default="1GiB", metavar="SIZE",
                        help="buffer the host read bandwidth is measured over (default: 1GiB; PCIe: the "
                             "256 MiB copy the streaming choice measures)")
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
    from hybridmoe.system.bandwidth import floor_bandwidth, floor_bandwidth_method
    from hybridmoe.system.host import host_info

    measure = parse_bytes(args.measure_bytes)
    engine_config = EngineConfig.from_kwargs(**engine_kwargs(args))
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
    bandwidth = floor_bandwidth(measure, engine_config.cpu_threads)
    print(f"host read:  {bandwidth / 1e9:.1f} GB/s ({floor_bandwidth_method()} over {format_bytes(measure)}, "
          f"{engine_config.cpu_threads or host.allowed_cpus} threads)")
    if host.gpus:
        pcie = measured_pcie_bandwidth(engine_config.device if engine_config.device.startswith("cuda") else "cuda")
        print(f"pcie h2d:   {pcie / 1e9:.1f} GB/s (pinned, {format_bytes(PCIE_MEASURE_BYTES)})")
    if args.model:
        for line in model_report(args.model, engine_config, bandwidth):
            print(line)
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


def print_choices(engine) -> None:
    """choices_line of a loaded LLMEngine, to stderr: what run/chat/serve chose (their stdout is the text)."""
    print(choices_line(engine.resolved_config, engine.runner.cuda_graph), file=sys.stderr, flush=True)


def model_report(model_dir: str, engine_config, bandwidth: float) -> list[str]:
    """What a run of model_dir with engine_config would choose, and its expected decode floor."""
    from hybridmoe.config import format_bytes, uses_hybrid
    from hybridmoe.experts.expert_bytes import cpu_expert_bytes
    from hybridmoe.experts.placement import model_footprint, placement_for
    from hybridmoe.models.registry import load_config
    from hybridmoe.system.auto import prefill_streaming_decision, resolve_engine_config
    from hybridmoe.system.expert_memory import memory_line
    from hybridmoe.weights.gguf_model_dir import resolve_model_path
    from hybridmoe.weights.loader import resolve_dtype

    model_dir = resolve_model_path(model_dir, engine_config)
    cls, config = load_config(model_dir)
    dtype = resolve_dtype(engine_config.dtype, config)
    ec = resolve_engine_config(engine_config, config, dtype, model_dir)
    lines = [f"model:      {config.get('model_type', cls.__name__)}, {config.num_hidden_layers} layers, compute "
             f"{str(dtype).removeprefix('torch.')}",
             choices_line(ec)]
    stats = None
    if uses_hybrid(ec):
        plan, stats = placement_for(cls, config, dtype, ec)
        fp = plan.footprint
        lines.append(f"placement:  {plan.describe()}")
    else:
        plan = None
        fp = model_footprint(cls, config, dtype, ec)
        lines.append(f"placement:  every routed expert on the CPU ({fp.num_experts} x {len(fp.moe_layers)} MoE layers)")
    if ec.expert_backend == "native":
        cpu_experts = [fp.num_experts - (len(plan.on_gpu(layer)) if plan else 0) for layer in fp.moe_layers]
        lines.append(memory_line(ec, cpu_experts, fp.hidden_size, fp.moe_intermediate_size))
    asked = replace(ec, prefill_streaming=engine_config.prefill_streaming,
                    prefill_streaming_tokens=engine_config.prefill_streaming_tokens)
    lines.append(f"streaming:  long prefill steps {prefill_streaming_decision(asked, config, dtype).reason}")
    if ec.expert_backend == "native":
        per_expert = cpu_expert_bytes(ec.expert_format, fp.moe_intermediate_size, fp.hidden_size, ec.expert_group_size)
    else:
        per_expert = 3 * fp.moe_intermediate_size * fp.hidden_size * dtype.itemsize
    experts_read = plan.cpu_experts_per_token(stats) if plan is not None else fp.top_k * len(fp.moe_layers)
    per_token = experts_read * per_expert
    if per_token == 0:
        lines.append("floor:      0.0 CPU experts: no routed expert is read on the CPU; decode is GPU-bound")
        return lines
    seconds = per_token / bandwidth
    lines.append(f"floor:      {experts_read:.1f} CPU experts x {format_bytes(per_expert)} = {format_bytes(per_token)} "
                 f"read per token / {bandwidth / 1e9:.1f} GB/s = {1e3 * seconds:.2f} ms "
                 f"({1 / seconds:.1f} tok/s at batch 1)")
    return lines
