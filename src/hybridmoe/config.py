"""Every knob a user sets. CLI flags and the server map onto EngineConfig one to one."""

from __future__ import annotations

from dataclasses import dataclass, fields

from hybridmoe.errors import HybridMoEError

DTYPES = ("auto", "float32", "bfloat16", "float16")
EXPERT_BACKENDS = ("torch", "native")
EXPERT_FORMATS = ("bf16", "int8", "int4")


@dataclass
class EngineConfig:
    dtype: str = "auto"
    """Compute dtype of the non-expert weights: "auto" keeps the checkpoint's own dtype."""

    device: str = "cpu"
    """Where attention, dense layers, router and KV cache run ("cpu" or "cuda")."""

    max_model_len: int | None = None
    """Longest prompt + completion, in tokens. None: the model's max_position_embeddings, capped at 4096."""

    max_num_seqs: int = 8
    """Most sequences decoded together in one step (the max batch)."""

    max_num_batched_tokens: int = 2048
    """Most tokens run through the model in one step: one per decoding sequence, the rest goes to
    prompt chunks, so long prompts are prefilled in pieces without stalling decoding streams."""

    expert_backend: str = "torch"
    """Where routed experts run: "torch" (the reference, any device) or "native" (the C++ CPU engine)."""

    expert_format: str = "bf16"
    """Weight format of routed experts in the native engine: bf16, int8 or int4."""

    expert_group_size: int = 128
    """Group size for int4 experts (32, 64 or 128)."""

    cpu_threads: int | None = None
    """Threads of the native CPU expert engine. None: every core."""

    cache_dir: str | None = None
    """Where hybridmoe keeps what it derives from a checkpoint: int8/int4 experts packed on a first start
    (reused on the next), and a GGUF file's config and tokenizer. None: $XDG_CACHE_HOME/hybridmoe
    (~/.cache/hybridmoe); "": no cache (experts are packed on every start)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise HybridMoEError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.expert_backend not in EXPERT_BACKENDS:
            raise HybridMoEError(
                f"expert_backend must be one of {', '.join(EXPERT_BACKENDS)}, got {self.expert_backend!r}")
        if self.expert_format not in EXPERT_FORMATS:
            raise HybridMoEError(
                f"expert_format must be one of {', '.join(EXPERT_FORMATS)}, got {self.expert_format!r}")
        if self.expert_group_size not in (32, 64, 128):
            raise HybridMoEError(f"expert_group_size must be 32, 64 or 128, got {self.expert_group_size}")
        if self.max_num_seqs < 1:
            raise HybridMoEError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise HybridMoEError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_num_seqs "
                f"({self.max_num_seqs}): every decoding sequence runs one token per step")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise HybridMoEError(f"max_model_len must be at least 1, got {self.max_model_len}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise HybridMoEError(f"cpu_threads must be at least 1, got {self.cpu_threads}")

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise HybridMoEError(
                f"unknown engine option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)
