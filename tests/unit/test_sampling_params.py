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
    ({"max_tokens": 0}, r"max_tokens must be an integer in \[1, 2147483647\], got 0"),
    ({"max_tokens": 10**40}, "max_tokens .*got an integer of 133 bits"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"temperature": -0.1}, r"temperature must be 0 \(greedy\) or in \[0.01, 100\]"),
    ({"temperature": 5e-324}, "temperature .*got 5e-324"),
    ({"temperature": 1e-40}, "temperature"),
    ({"temperature": 1e6}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -1}, r"top_k must be an integer in \[0, 2147483647\] \(0 disables\)"),
    ({"top_k": 10**30}, "top_k"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_p": 1.1}, r"min_p must be in \[0, 1\]"),
    ({"repetition_penalty": 0.0}, r"repetition_penalty must be in \[0.01, 100\] \(1 disables\)"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    ({"repetition_penalty": 1e300}, "repetition_penalty"),
    ({"presence_penalty": 3.0}, r"presence_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop must hold non-empty strings"),
    ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ({"stop_token_ids": [2**40]}, "stop_token_ids"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids holds 65 ids; at most 64"),
    ({"stop": ["x"] * 65}, "stop holds 65 strings; at most 64"),
    ({"stop": ["x" * 513]}, "a stop string has 513 characters; at most 512"),
    ({"stop": ["x" * 500] * 9}, "stop strings hold 4500 characters together; at most 4096"),
    ({"top_k": True}, "top_k"),
])
def test_invalid_values_name_the_field_and_the_allowed_range(kwargs, needle):
    with pytest.raises(HybridMoEError, match=needle):
        SamplingParams(**kwargs)


def test_the_edges_of_each_range_are_valid():
    SamplingParams(temperature=0.01, repetition_penalty=0.01, top_k=2**31 - 1, max_tokens=2**31 - 1)
    SamplingParams(temperature=100, repetition_penalty=100, stop=["x" * 512] * 8, stop_token_ids=list(range(64)))


def test_a_huge_value_is_named_in_one_short_line():
    with pytest.raises(HybridMoEError) as e:
        SamplingParams(top_k=10**5000)
    assert "\n" not in str(e.value) and len(str(e.value)) < 120


def test_errors_are_value_errors_for_library_users():
    with pytest.raises(ValueError):
        SamplingParams(top_p=2)
