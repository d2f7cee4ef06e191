import pytest

from hybridmoe import SamplingParams
from hybridmoe.errors import HybridMoEError


def test_defaults_are_valid_and_not_greedy():
    p = SamplingParams()
    assert p.max_tokens == 16 and not p.greedy
    assert SamplingParams(temperature=0).greedy


def test_a_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="###").stop == ["###"]


@pytest.mark.parametrize("kwargs, needle", [
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -1}, r"top_k must be an integer >= 0 \(0 disables\)"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": 1.1}, r"min_p must be in \[0, 1\]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
    ({"presence_penalty": 3.0}, r"presence_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop must hold non-empty strings"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ({"top_k": True}, "top_k"),
])
def test_invalid_values_name_the_field_and_the_allowed_range(kwargs, needle):
    with pytest.raises(HybridMoEError, match=needle):
        SamplingParams(**kwargs)


def test_errors_are_value_errors_for_library_users():
    with pytest.raises(ValueError):
        SamplingParams(top_p=2)
