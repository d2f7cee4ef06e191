"""Random values in a tiny model's config.json: loading either succeeds or fails with one HybridMoEError line,
never another exception, and fast (a checked value, the memory check or the layer check stops it first)."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridmoe.checkpoint.make import make_checkpoint
from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.errors import HybridMoEError

FAMILIES = ("qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3", "glm4_moe", "minimax_m2", "gpt_oss")
ABSENT_KEYS = ("head_dim", "rope_parameters", "quantization_config", "dtype", "layer_types", "eos_token_id",
               "num_local_experts", "rope_interleave")
"""Keys some family reads that the tiny configs leave out."""

VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 70), st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, 2, 7, 10**6, 10**9, 10**18]), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8), st.lists(st.one_of(st.integers(-2, 5), st.text(max_size=3)), max_size=4),
    st.dictionaries(st.sampled_from(["type", "rope_type", "factor", "rope_theta", "beta_fast", "quant_method",
                                     "bits", "group_size", "weight_block_size"]),
                    st.one_of(st.none(), st.integers(-2, 200), st.floats(), st.sampled_from(["yarn", "linear", "gptq"]),
                              st.lists(st.integers(0, 200), max_size=3)), max_size=4),
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    made = {}
    for family in FAMILIES:
        make_checkpoint(family, "tiny", root / family, dtype="fp32", progress=False)
        made[family] = (root / family, json.loads((root / family / "config.json").read_text()))
    return made


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_config_value_loads_or_fails_with_one_line(checkpoints, family, data):
    path, config = checkpoints[family]
    keys = data.draw(st.lists(st.sampled_from(sorted(config) + list(ABSENT_KEYS)), min_size=1, max_size=3,
                              unique=True))
    mutated = dict(config)
    for key in keys:
        if data.draw(st.booleans(), label=f"drop {key}"):
            mutated.pop(key, None)
        else:
            mutated[key] = data.draw(VALUES, label=key)
    (path / "config.json").write_text(json.dumps(mutated))
    try:
        load_model(path, EngineConfig(cache_dir=""))
    except HybridMoEError as e:
        assert "\n" not in str(e)
    finally:
        (path / "config.json").write_text(json.dumps(config))
