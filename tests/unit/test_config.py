import pytest

from hybridmoe.config import EngineConfig
from hybridmoe.errors import HybridMoEError


def test_defaults_are_valid():
    cfg = EngineConfig()
    assert cfg.dtype == "auto" and cfg.expert_backend == "auto"


@pytest.mark.parametrize("kwargs, needle", [
    ({"dtype": "float8"}, "dtype must be one of"),
    ({"expert_format": "int3"}, "expert_format"),
    ({"expert_group_size": 48}, "expert_group_size"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"cpu_threads": 0}, "cpu_threads"),
])
def test_bad_values_raise_clear_errors(kwargs, needle):
    with pytest.raises(HybridMoEError, match=needle):
        EngineConfig(**kwargs)


def test_unknown_option_is_named():
    with pytest.raises(HybridMoEError, match="gpu_mem"):
        EngineConfig.from_kwargs(gpu_mem=3)
