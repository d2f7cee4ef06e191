"""Every knob a user sets. CLI flags and the server map onto EngineConfig one to one."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from hybridmoe.errors import HybridMoEError

DTYPES = ("auto", "float32", "bfloat16", "float16")
EXPERT_BACKENDS = ("auto", "torch", "native")
EXPERT_FORMATS = ("auto", "bf16", "int8", "int4", "fp8", "mxfp4")
EXPERT_PLACEMENTS = ("uniform", "frequency", "front-loading")
PREFILL_STREAMING = ("auto", "on", "off")
VERIFY_EXPERTS = ("full", "header")
DEFAULT_EXPERT_GROUP_SIZE = 128
MAX_CPU_THREADS = 1024
"""The most workers one CPU expert pool may have (the native engine's kMaxThreads, csrc/binding_args.h)."""
"""int4 group size where neither expert_group_size nor the checkpoint gives one."""
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(value: int | str) -> int:
    """16GiB, 500MiB, 2.5GB, "1073741824" or an int -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
    if m is None or m.group(2).lower() not in _SIZE_UNITS:
        raise HybridMoEError(f"cannot read {value!r} as a size; write e.g. 16GiB, 500MiB, 24GB or a byte count")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def format_bytes(n: float) -> str:
    """Bytes as people read them: 1.50 GiB, 12.00 MiB, 512 B."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


KV_CACHE_DTYPES = ("auto", "fp8")
DEFAULT_KV_BLOCK_SIZE = 64
"""KV-cache block size in positions (EngineConfig.kv_block_size's default)."""


@dataclass
class EngineConfig:
    dtype: str = "auto"
    """Compute dtype of the non-expert weights: "auto" keeps the checkpoint's own dtype."""

    device: str = "auto"
    """Where attention, dense layers, router and KV cache run: "cpu", "cuda", or "auto" (cuda when torch sees
    a GPU, else cpu)."""

    max_model_len: int | None = None
    """Longest prompt + completion, in tokens. None: the model's max_position_embeddings, or what the KV cache
    holds if that is less (kv_plan.py). More than max_position_embeddings (or what a YaRN rope_scaling stretches
    it to), or than kv_cache_budget holds, fails the load."""

    kv_cache_budget: int | str | None = None
    """Memory of the paged KV cache ("8GiB" or bytes), on the device that runs attention. None: max_num_seqs x
    4096 tokens' worth, or one max_model_len sequence if that is more."""

    kv_cpu_budget: int | str | None = None
    """Host memory for KV blocks evicted from the device's cache (the host tier: a re-sent prefix comes back
    over PCIe instead of being computed again). None: as large as the device's cache when that is a GPU (at most
    half the host's available memory), none on the CPU; 0 turns it off."""

    kv_cache_dtype: str = "auto"
    """"auto": the KV cache in the compute dtype; "fp8": float8 e4m3 with a float32 scale per token and head
    (layers/kv_quant.py), half a bf16 cache's memory; attention then runs its torch path on the GPU too (the fused
    Triton kernels read the compute dtype)."""

    kv_block_size: int = DEFAULT_KV_BLOCK_SIZE
    """Positions per KV-cache block (a power of two, 16 to 256): the unit of allocation and of prefix reuse."""

    prefix_caching: bool = True
    """Keep the KV blocks of finished requests and reuse them for a later prompt that starts with the same
    tokens (full blocks only), least recently used evicted first."""

    max_num_seqs: int = 8
    """Most sequences decoded together in one step (the max batch)."""

    max_num_batched_tokens: int = 2048
    """Most tokens run through the model in one step: one per decoding sequence, the rest goes to
    prompt chunks, so long prompts are prefilled in pieces without stalling decoding streams."""

    expert_backend: str = "auto"
    """Where routed experts run: "torch" (the reference, any device), "native" (the C++ CPU engine), or "auto":
    native when it is built and can hold the model's precision (SiLU experts, a bf16/fp16 compute dtype, or a
    converted directory), else torch (so float32 models stay exact)."""

    expert_format: str = "auto"
    """Weight format of routed experts in the native engine: bf16, int8, int4, fp8 (e4m3, a float32 scale per
    128x128 block) or mxfp4 (e2m1, an e8m0 power-of-two scale per 32 input channels; hidden and intermediate sizes
    multiples of 32). "auto": the format nearest the checkpoint's own (GGUF Q8_0/Q5/Q6 -> int8, Q4/Q3/Q2 -> int4
    g32, GPTQ/AWQ 4-bit -> int4 in their group size when it is 32/64/128; DeepSeek-V3's block FP8 -> fp8 and
    gpt-oss's MXFP4 -> mxfp4, their codes as they are; float weights -> bf16), said in a log line;
    weights/native_format.py has the table."""

    expert_group_size: int | None = None
    """Group size for int4 experts (32, 64 or 128). None: the checkpoint's own where its experts are 4-bit in
    groups of one of these (GPTQ/AWQ's, GGUF Q4's 32, a converted directory's), else 128 (also for any format
    but int4, which ignores it); the load resolves it
    (weights/native_format.py)."""

    expert_zero_points: bool | None = None
    """int4 experts with a zero point per group (asymmetric) instead of symmetric groups (other formats ignore
    it). None: on for GPTQ/AWQ
    4-bit checkpoints, whose own codes and zero points then load without a float round trip; off otherwise."""

    cpu_threads: int | None = None
    """Threads of the native CPU expert engine. None: every core."""

    cache_dir: str | None = None
    """Where hybridmoe keeps what it derives from a checkpoint: int8/int4 experts packed on a first start
    (reused on the next), and a GGUF file's config and tokenizer. None: $XDG_CACHE_HOME/hybridmoe
    (~/.cache/hybridmoe); "": no cache (experts are packed on every start)."""

    verify_experts: str = "full"
    """How the packed experts of a converted directory or of the cache are checked on load: "full" (every
    expert's bytes against its CRC-32 in the manifest: every packed byte is read once, in parallel) or "header"
    (each layer file's header checksum, size and expert 0 only; the files are mapped, not read)."""

    gpu_memory_budget: int | str | None = None
    """Most GPU memory the process may use, KV cache and workspace included: bytes or a size like "16GiB".
    What the non-expert weights, KV cache and workspace leave fills with routed experts (expert_placement).
    None: on a GPU with the native engine, 90% of the GPU's free memory; otherwise no routed expert on the
    device unless gpu_experts_per_layer says so. With device "cpu" the CPU stands in for the GPU."""

    expert_placement: str = "uniform"
    """Which routed experts fill the budget: "uniform" (the same count in every MoE layer), "frequency" (the
    most-routed (layer, expert) pairs first; needs expert_stats) or "front-loading" (whole layers from the
    first MoE layer on)."""

    expert_stats: str | None = None
    """Routing statistics JSON from `hybridmoe profile-experts`: "frequency" needs it; the other policies use
    it to put each layer's most-routed experts on the GPU first."""

    gpu_experts_per_layer: int | None = None
    """Routed experts per MoE layer kept on the GPU, instead of what the policy derives from the budget."""

    gpu_experts_packed: bool = True
    """With int4 / int8 CPU experts on CUDA: keep the GPU's routed experts packed in that format too (the same
    codes as on the CPU, 1/4 or 1/2 of bf16's memory, so the budget holds 4 or 2 times as many: Qwen3-30B-A3B
    int4 under 16 GiB decodes ~1.3x faster); False: in the model's dtype."""

    deferred_experts: int = 0
    """Expert deferral: each token's K lowest-weighted routed experts run on the CPU while the next layer's
    attention runs, and their output joins the residual one layer later. 0 is exact."""

    cuda_graph: bool = True
    """Replay each decode step (batch up to max_num_seqs) as one captured CUDA graph, CPU experts included
    (through the native handoff). Used on CUDA only, when every CPU expert layer is native; prefill and
    anything else runs eagerly. False (--no-cuda-graph): every step eagerly, the same tokens."""

    prefill_streaming: str = "auto"
    """Long steps (prefill chunks) of at least prefill_streaming_tokens tokens copy each layer's packed CPU
    experts to the GPU over PCIe (double-buffered, from page-locked memory) and run them there instead of on
    the CPU: "on", "off", or "auto": on when the measured PCIe bandwidth says a max_num_batched_tokens step
    gets faster (hybrid split on CUDA with the native engine only); its device buffers count in the budget."""

    prefill_streaming_tokens: int | None = None
    """Fewest tokens in a step for prefill_streaming. None: where streaming starts to beat the CPU (from the
    measured PCIe bandwidth and the CPU's estimated FLOP/s; `hybridmoe doctor` prints it)."""

    revision: str | None = None
    """Branch, tag or commit hash of a model named by its Hugging Face repo id (--model org/name, or
    org/name:Q4_K_M for a GGUF repo's files of that quant). None: the repo's default branch. A local model path
    ignores it."""

    lora: str | None = None
    """A PEFT LoRA adapter directory (adapter_config.json and adapter_model.safetensors, as peft's save_pretrained
    writes them), merged into the weights at load: W += scaling * B @ A on attention, dense-MLP, shared-expert and
    linear-attention projections (weights/lora.py). An adapter on the routed experts, the router, the embeddings
    or lm_head, a LoRA variant (DoRA, ...) or one made for another base model fails the load. None: no adapter."""

    mtp: bool = False
    """Load the checkpoint's multi-token-prediction module (mtp.*: Qwen3-Next, Qwen3.5-MoE) beside the model: its
    weights, its routed experts as one more MoE layer of the expert backend and its own KV cache; the model's
    mtp_logits then gives a draft of the token after next (models/mtp.py). The engine does not use it yet (no
    speculative decoding). False: mtp.* is skipped and costs nothing. Other families, or deferred_experts, fail the
    load with it."""

    tensor_parallel_size: int = 1
    """Processes that split the attention and dense layers by heads (tensor parallelism, distributed/): the calling
    one (rank 0) and tensor_parallel_size - 1 workers it starts, over gloo on the CPU or NCCL with one GPU per rank
    (cuda:0 to cuda:N-1). Rank 0 alone holds and runs the routed experts, with expert_backend's engine, and schedules
    and samples; kv_cache_budget is each rank's. The head counts (num_attention_heads, num_key_value_heads) and the
    MLPs' intermediate sizes must divide by it. Steps run eagerly (no CUDA graphs); the hybrid GPU expert split,
    lora, mtp and the KV cache's host tier are refused with it, and so are the families whose attention it does not
    split (Qwen3-Next, Qwen3.5-MoE, DeepSeek-V3.2, MiniMax-M2, gpt-oss). 1: one process."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise HybridMoEError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.device == "auto":
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.gpu_memory_budget is not None:
            self.gpu_memory_budget = parse_bytes(self.gpu_memory_budget)
            if self.gpu_memory_budget < 1:
                raise HybridMoEError(f"gpu_memory_budget must be positive, got {self.gpu_memory_budget}")
        if self.expert_placement not in EXPERT_PLACEMENTS:
            raise HybridMoEError(
                f"expert_placement must be one of {', '.join(EXPERT_PLACEMENTS)}, got {self.expert_placement!r}")
        if self.gpu_experts_per_layer is not None and self.gpu_experts_per_layer < 0:
            raise HybridMoEError(f"gpu_experts_per_layer must be at least 0, got {self.gpu_experts_per_layer}")
        if self.deferred_experts < 0:
            raise HybridMoEError(f"deferred_experts must be at least 0, got {self.deferred_experts}")
        if self.dtype not in DTYPES:
            raise HybridMoEError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.expert_backend not in EXPERT_BACKENDS:
            raise HybridMoEError(
                f"expert_backend must be one of {', '.join(EXPERT_BACKENDS)}, got {self.expert_backend!r}")
        if self.expert_format not in EXPERT_FORMATS:
            raise HybridMoEError(
                f"expert_format must be one of {', '.join(EXPERT_FORMATS)}, got {self.expert_format!r}")
        if self.expert_group_size not in (None, 32, 64, 128):
            raise HybridMoEError(f"expert_group_size must be 32, 64 or 128, got {self.expert_group_size}")
        if self.max_num_seqs < 1:
            raise HybridMoEError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise HybridMoEError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_num_seqs "
                f"({self.max_num_seqs}): every decoding sequence runs one token per step")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise HybridMoEError(f"max_model_len must be at least 1, got {self.max_model_len}")
        if self.kv_cache_budget is not None:
            self.kv_cache_budget = parse_bytes(self.kv_cache_budget)
            if self.kv_cache_budget < 1:
                raise HybridMoEError(f"kv_cache_budget must be positive, got {self.kv_cache_budget}")
        if self.kv_cpu_budget is not None:
            self.kv_cpu_budget = parse_bytes(self.kv_cpu_budget)
            if self.kv_cpu_budget < 0:
                raise HybridMoEError(f"kv_cpu_budget must be 0 or more, got {self.kv_cpu_budget}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise HybridMoEError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                                 f"got {self.kv_cache_dtype!r}")
        if self.kv_block_size not in (16, 32, 64, 128, 256):
            raise HybridMoEError(f"kv_block_size must be 16, 32, 64, 128 or 256, got {self.kv_block_size}")
        if self.prefill_streaming not in PREFILL_STREAMING:
            raise HybridMoEError(f"prefill_streaming must be one of {', '.join(PREFILL_STREAMING)}, "
                                 f"got {self.prefill_streaming!r}")
        if self.prefill_streaming_tokens is not None and self.prefill_streaming_tokens < 1:
            raise HybridMoEError(f"prefill_streaming_tokens must be at least 1, got {self.prefill_streaming_tokens}")
        if self.verify_experts not in VERIFY_EXPERTS:
            raise HybridMoEError(f"verify_experts must be one of {', '.join(VERIFY_EXPERTS)}, "
                                 f"got {self.verify_experts!r}")
        if self.revision is not None and re.fullmatch(r"\S+", self.revision) is None:
            raise HybridMoEError(f"revision must be a branch, tag or commit hash (no spaces), got {self.revision!r}")
        if self.cpu_threads is not None and not 1 <= self.cpu_threads <= MAX_CPU_THREADS:
            raise HybridMoEError(f"cpu_threads must be between 1 and {MAX_CPU_THREADS}, got {self.cpu_threads}")

    @property
    def expert_group_size_or_default(self) -> int:
        """expert_group_size, or while it is unset (None: the load has not read the checkpoint's yet) the default:
        what sizes estimated from an unresolved config assume."""
        return self.expert_group_size or DEFAULT_EXPERT_GROUP_SIZE

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise HybridMoEError(
                f"unknown engine option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)


def uses_hybrid(engine_config: EngineConfig) -> bool:
    """Whether the routed experts are split between the GPU and the CPU (or deferred)."""
    return (engine_config.gpu_memory_budget is not None or engine_config.gpu_experts_per_layer is not None
            or engine_config.deferred_experts > 0)


DEFAULT_MAX_MODEL_LEN = 4096


def check_max_model_len(model_config, engine_config: EngineConfig) -> None:
    """A max_model_len over the positions the model knows is an error; a model that states none takes any."""
    limit = position_limit(model_config)
    if engine_config.max_model_len is not None and limit is not None and engine_config.max_model_len > limit:
        raise HybridMoEError(
            f"max_model_len {engine_config.max_model_len} (--max-model-len) exceeds the model's "
            f"max_position_embeddings {limit}; give --max-model-len {limit} or less")


def position_limit(model_config) -> int | None:
    """max_position_embeddings, or YaRN's original length x factor when a rope_scaling added to config.json
    stretches the model past it (as Qwen3's model card says to enable long context)."""
    limit = model_config.get("max_position_embeddings")
    rope = model_config.get("rope_parameters") or {}
    original = rope.get("original_max_position_embeddings")
    if limit and rope.get("rope_type") == "yarn" and rope.get("factor") and original:
        limit = max(limit, int(rope["factor"] * original))
    return limit or None
