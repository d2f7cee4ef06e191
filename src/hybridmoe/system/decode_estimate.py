"""What one decode token reads, device by device, and how long that takes at the measured bandwidths.

At batch 1 a decode step reads every weight the token passes once: in each layer the attention (its own norms
included), the layer's norms, the router, the shared experts or the dense MLP; then the final norm and the
output head; one row of the embedding; the KV cache up to the context; and the routed experts the token picks,
top_k per MoE layer. The routed experts are read where they live: with the model (the GPU's share of a hybrid
split, or all of them for the torch reference without one) or from host memory by the CPU expert engine.

Each read takes its bytes over the bandwidth measured for its reader: GPU memory, host memory as torch's
matrix-vector products read it (the model's own layers on the CPU), host memory as the native engine reads
it. The reads follow one another, except that a layer's routed experts on the CPU and on the GPU run at once
(the hybrid split), so only the longer of those two counts. Compute, launches and the step loop's own time are
left out: the estimate is what the memory allows, which decode approaches where a token reads gigabytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from hybridmoe.config import format_bytes
from hybridmoe.experts.torch_ref import TorchExperts

MODEL_PARTS = ("attention", "dense_mlp", "shared_experts", "router", "norms", "output_head", "embedding_row",
               "kv_cache")
"""What a token reads on the model's device besides the routed experts."""

_ROUTER = re.compile(r"\.gate\.[^.]+$")  # mlp.gate.weight, block_sparse_moe.gate.weight, gate.e_score_correction_bias


def model_part(name: str) -> str:
    """The part of MODEL_PARTS a model parameter belongs to, by its name (as in the checkpoint)."""
    if name.startswith("lm_head."):
        return "output_head"
    if "embed_tokens" in name:
        return "embedding_row"
    if ".self_attn." in name or ".linear_attn." in name:
        return "attention"
    if "shared_expert" in name:
        return "shared_experts"
    if _ROUTER.search(name):
        return "router"
    if "norm" in name.split(".")[-2]:
        return "norms"
    return "dense_mlp"


def model_token_bytes(model_cls, config, dtype: torch.dtype, context: int) -> dict[str, int]:
    """Bytes of each of MODEL_PARTS one decode token reads at a context of `context` tokens, from the model
    built on the meta device (nothing allocated). A tied output head reads the whole embedding table."""
    with torch.device("meta"):
        model = model_cls(config, TorchExperts()).to(dtype)
    model.tie_weights()
    parts = dict.fromkeys(MODEL_PARTS, 0)
    for name, p in model.named_parameters(remove_duplicate=False):
        part = model_part(name)
        nbytes = p.numel() * p.element_size()
        parts[part] += nbytes // p.shape[0] if part == "embedding_row" else nbytes
    parts["kv_cache"] += model.kv_bytes_per_token() * context + model.state_bytes_per_seq()  # + recurrent states
    return parts


@dataclass
class TokenBytes:
    """What one decode token reads: MODEL_PARTS, and the routed experts by where they live."""

    model: dict[str, int]
    """Bytes of each of MODEL_PARTS, on the model's device."""
    experts_with_model: float
    """Routed experts a token reads where the model runs: the GPU's share of a hybrid split, or every one for
    the torch reference without a split."""
    expert_bytes_with_model: int
    experts_on_host: float
    """Routed experts a token reads from host memory through the CPU expert engine."""
    expert_bytes_on_host: int
    context: int
    """The tokens in the KV cache the estimate assumes."""

    @property
    def routed_with_model(self) -> float:
        return self.experts_with_model * self.expert_bytes_with_model

    @property
    def routed_on_host(self) -> float:
        return self.experts_on_host * self.expert_bytes_on_host


@dataclass(frozen=True)
class Bandwidths:
    """Measured read bandwidths, bytes/s."""

    host: float
    """Host memory as the native engine reads it (bandwidth.floor_bandwidth)."""
    host_torch: float
    """Host memory as torch's matrix-vector products read it, in the model's dtype (bandwidth.torch_gemv_bandwidth)."""
    gpu: float | None = None
    """GPU memory (bandwidth.device_copy_bandwidth); None without a GPU."""


@dataclass(frozen=True)
class Read:
    """One kind of bytes a token reads, the device it reads them on and how fast."""

    what: str
    device: str
    """"cpu" or "gpu"."""
    nbytes: float
    bandwidth: float
    reader: str

    @property
    def seconds(self) -> float:
        return self.nbytes / self.bandwidth


@dataclass
class DecodeEstimate:
    token: TokenBytes
    model_read: Read
    """MODEL_PARTS, on the model's device."""
    experts_with_model: Read
    experts_on_host: Read
    overlap: bool
    """The routed experts on the host and on the GPU run at once (the model on a GPU)."""

    @property
    def seconds(self) -> float:
        m, g, h = self.model_read.seconds, self.experts_with_model.seconds, self.experts_on_host.seconds
        return m + (max(g, h) if self.overlap else g + h)

    @property
    def decode_tok_s(self) -> float:
        return 1 / self.seconds if self.seconds > 0 else float("inf")

    def device_seconds(self) -> dict[str, float]:
        """Each device's read time per token."""
        times: dict[str, float] = {}
        for r in (self.model_read, self.experts_with_model, self.experts_on_host):
            times[r.device] = times.get(r.device, 0.0) + r.seconds
        return times

    @property
    def bound(self) -> str:
        """The device whose reads take longest: "cpu" or "gpu"."""
        times = self.device_seconds()
        return max(times, key=times.get)

    def bytes_per_token(self) -> dict[str, float]:
        """Each part's bytes, the routed experts by device (routed_experts_cpu, routed_experts_gpu)."""
        routed = {"routed_experts_cpu": 0.0, "routed_experts_gpu": 0.0}
        for r in (self.experts_with_model, self.experts_on_host):
            routed[f"routed_experts_{r.device}"] += r.nbytes
        return {**self.token.model, **routed}

    def lines(self) -> list[str]:
        """`hybridmoe doctor`'s lines: what a token reads, and the estimate."""
        t = self.token
        parts = sorted(t.model.items(), key=lambda kv: -kv[1])
        shown = ", ".join(f"{name.replace('_', ' ')} {format_bytes(n)}" for name, n in parts if n)
        routed = []
        for count, size, read in ((t.experts_on_host, t.expert_bytes_on_host, self.experts_on_host),
                                  (t.experts_with_model, t.expert_bytes_with_model, self.experts_with_model)):
            if count:
                routed.append(f"{count:.1f} on the {read.device.upper()} x {format_bytes(size)}")
        total = sum(self.bytes_per_token().values())
        times = [f"{r.what} {format_bytes(r.nbytes)} / {r.bandwidth / 1e9:.1f} GB/s ({r.reader}) = "
                 f"{1e3 * r.seconds:.2f} ms" for r in (self.model_read, self.experts_on_host, self.experts_with_model)
                 if r.nbytes]
        how = "the CPU's and the GPU's routed experts at once" if self.overlap else "one after the other"
        reads = (f"reads:      {format_bytes(total)} per token (KV cache at {t.context} tokens): {shown}; routed "
                 f"experts {' + '.join(routed) or 'none'}")
        estimate = (f"estimate:   {'; '.join(times)}; {how}: {1e3 * self.seconds:.2f} ms = "
                    f"{self.decode_tok_s:.1f} tok/s at batch 1, bound by the {self.bound.upper()}")
        return [reads, estimate]

    def to_json(self) -> dict:
        reads = [{"what": r.what, "device": r.device, "bytes": r.nbytes, "bandwidth_bytes_s": r.bandwidth,
                  "reader": r.reader, "seconds": r.seconds}
                 for r in (self.model_read, self.experts_with_model, self.experts_on_host)]
        return {"decode_tok_s": self.decode_tok_s, "seconds_per_token": self.seconds, "bound": self.bound,
                "context_tokens": self.token.context, "bytes_per_token": self.bytes_per_token(),
                "device_seconds": self.device_seconds(), "overlap": self.overlap, "reads": reads,
                "routed_experts_per_token": {"with_model": self.token.experts_with_model,
                                             "on_host": self.token.experts_on_host}}


def estimate_decode(token: TokenBytes, on_gpu: bool, native_host_experts: bool, bw: Bandwidths) -> DecodeEstimate:
    """The time one decode token takes at batch 1 with the model on the GPU (on_gpu) or the CPU; the routed
    experts in host memory read by the native engine (native_host_experts) or by torch."""
    device, model_bw = ("gpu", bw.gpu) if on_gpu else ("cpu", bw.host_torch)
    if model_bw is None:
        raise ValueError("a model on the GPU needs the GPU's measured bandwidth (Bandwidths.gpu)")
    model_reader = "device copy" if on_gpu else "torch matrix-vector"
    host = (bw.host, "native engine") if native_host_experts else (bw.host_torch, "torch matrix-vector")
    return DecodeEstimate(
        token,
        Read("model weights and KV cache", device, sum(token.model.values()), model_bw, model_reader),
        Read("routed experts with the model", device, token.routed_with_model, model_bw, model_reader),
        Read("routed experts on the CPU engine", "cpu", token.routed_on_host, *host),
        overlap=on_gpu)
