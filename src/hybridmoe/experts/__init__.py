from hybridmoe.experts.base import ExpertBackend
from hybridmoe.experts.torch_ref import TorchExperts, ref_moe

__all__ = ["ExpertBackend", "TorchExperts", "ref_moe"]
