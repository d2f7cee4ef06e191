"""hybridmoe: Mixture-of-Experts LLMs larger than the GPU, routed experts on the CPU.

Public API: LLM, SamplingParams, EngineConfig, CpuExperts. Imported lazily so that
`import hybridmoe` stays cheap (the CLI starts fast) and a missing native module only
matters to whoever uses CpuExperts.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "hybridmoe.llm",
    "SamplingParams": "hybridmoe.sampling_params",
    "EngineConfig": "hybridmoe.config",
    "CpuExperts": "hybridmoe.experts.cpu_experts",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hybridmoe' has no attribute {name!r}")
