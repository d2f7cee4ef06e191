"""The decode floor: the time one token takes at batch 1 if the CPU did nothing but read the routed-expert
weights that token needs from memory, at the host's measured read bandwidth.

Counted from the loaded model, not from the config: per MoE layer, the experts the placement left in CPU
memory and the bytes the CPU engine actually holds for each (packed int4/int8/bf16, scales included).
Assumption, stated in every report: with top-k routing and one token, a token reads K experts per MoE
layer, each GPU-resident with probability (its layer's routing share of the GPU experts): measured over
the benchmark's own decode steps (decode_routing) or from given routing statistics; without either,
g/E for g GPU experts of E (uniform routing). Deferred experts still run on the CPU: they count.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from hybridmoe.experts.placement_stats import RoutingCounter
from hybridmoe.sampling_params import SamplingParams

ASSUMPTION = ("top-k routing, 1 token: K experts per MoE layer, minus the share of the routing that "
              "lands on GPU-resident experts (measured over the decode steps)")


@dataclass(frozen=True)
class LayerExperts:
    """Where one MoE layer's routed experts live."""

    layer: int
    experts: int
    """E: routed experts of the layer."""
    on_gpu: int
    cpu_bytes_per_expert: float
    """Bytes the CPU engine reads for one of its experts (0 when none is on the CPU)."""
    gpu_share: float
    """Expected fraction of a token's routed experts that are GPU-resident."""


@dataclass(frozen=True)
class DecodeFloor:
    layers: list[LayerExperts]
    top_k: int
    bandwidth: float
    """Host read bytes/s, measured in the same run."""
    bandwidth_method: str

    @property
    def cpu_experts_per_token(self) -> float:
        return sum(self.top_k * (1.0 - layer.gpu_share) for layer in self.layers)

    @property
    def bytes_per_token(self) -> float:
        return sum(self.top_k * (1.0 - layer.gpu_share) * layer.cpu_bytes_per_expert for layer in self.layers)

    @property
    def seconds(self) -> float:
        """Time per token at the floor; 0 when no routed expert is read on the CPU."""
        return self.bytes_per_token / self.bandwidth

    def per_moe_layer_seconds(self) -> float:
        return self.seconds / len(self.layers) if self.layers else 0.0

    def to_json(self) -> dict:
        return {"assumption": ASSUMPTION, "top_k": self.top_k, "bandwidth_gbps": self.bandwidth / 1e9,
                "bandwidth_method": self.bandwidth_method, "cpu_experts_per_token": self.cpu_experts_per_token,
                "bytes_per_token": self.bytes_per_token, "seconds": self.seconds,
                "layers": [asdict(layer) for layer in self.layers]}


def _bytes_per_expert(cpu_layer) -> float:
    """Bytes one expert of a CPU engine (CpuExperts or the torch stand-in) occupies, hence is read per use."""
    if cpu_layer is None or cpu_layer.num_experts == 0:
        return 0.0
    packed = getattr(cpu_layer, "packed_bytes", None)
    if packed is None:  # torch weights [E, I, H] / [E, H, I]
        packed = sum(w.numel() * w.element_size() for w in (cpu_layer.gate, cpu_layer.up, cpu_layer.down))
    return packed / cpu_layer.num_experts


def layer_experts(model, stats=None) -> list[LayerExperts]:
    """Each MoE layer's expert placement and CPU bytes per expert, read off the loaded model's backend."""
    experts = model.experts
    E, inter = model.expert_dims()
    out = []
    for layer in model.moe_layers:
        if hasattr(experts, "cpu_engine"):  # the hybrid split
            gpu = experts.gpu_experts(layer)
            cpu_bytes = _bytes_per_expert(experts.cpu_engine(layer))
        elif hasattr(experts, "layer_experts"):  # every expert in the native engine
            gpu, cpu_bytes = [], _bytes_per_expert(experts.layer_experts(layer))
        else:  # the torch reference: experts live where the model runs
            on_cpu = model.lm_head.weight.device.type == "cpu"
            gpu = [] if on_cpu else list(range(E))
            cpu_bytes = 3 * inter * model.config.hidden_size * model.lm_head.weight.element_size() if on_cpu else 0.0
        if stats is not None and sum(stats.counts[layer]):
            counts = stats.counts[layer]
            share = sum(counts[e] for e in gpu) / sum(counts)
        else:
            share = len(gpu) / E
        out.append(LayerExperts(layer, E, len(gpu), float(cpu_bytes), share))
    return out


def decode_floor(model, bandwidth: float, bandwidth_method: str, stats=None) -> DecodeFloor:
    return DecodeFloor(layer_experts(model, stats), model.config.num_experts_per_tok, bandwidth, bandwidth_method)


def floor_ratio(decode_seconds: float, floor: DecodeFloor) -> float:
    """Measured decode time per token / the floor's (nan when the floor is 0: GPU-bound)."""
    return decode_seconds / floor.seconds if floor.seconds > 0 else float("nan")


def decode_routing(engine, prompt: list[int], gen_len: int):
    """ExpertStats of the routed experts chosen by gen_len - 1 decode steps after `prompt` (the prompt's own
    routing left out), from one eager run with a counter between the model and its experts (graphs off:
    counting reads the ids on the host)."""
    runner, model = engine.runner, engine.runner.model
    # eager steps one at a time (no step launched ahead: the counter reads each step's ids as it runs)
    (graphs, ahead), runner.cuda_graph, runner.lookahead = (runner.cuda_graph, runner.lookahead), False, False
    counter = RoutingCounter.install(model)
    try:
        engine.add_request(prompt, SamplingParams(max_tokens=gen_len, temperature=0, ignore_eos=True))
        engine.step()  # the prompt
        counter.reset()
        while engine.has_unfinished():
            engine.step()
    finally:
        counter.uninstall(model)
        runner.cuda_graph, runner.lookahead = graphs, ahead
    return counter.stats()
