import json
import shutil

import pytest

from hybridmoe import LLM, SamplingParams
from hybridmoe.cli import main
from hybridmoe.config import EngineConfig
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.errors import HybridMoEError


def test_run_streams_the_completion_to_stdout(tiny_qwen3_fp32, capsys):
    rc = main(["run", "--model", str(tiny_qwen3_fp32), "--prompt", "Once upon a time", "--max-new-tokens", "12",
               "--temperature", "0", "--ignore-eos", "--max-num-seqs", "2"])
    out, err = capsys.readouterr()
    expected = LLM(tiny_qwen3_fp32).generate("Once upon a time", SamplingParams(max_tokens=12, temperature=0,
                                                                           ignore_eos=True))[0]
    assert rc == 0 and out == expected.text + "\n"
    assert "[12 tokens, length;" in err


def test_without_max_new_tokens_the_completion_runs_to_the_end_of_the_context(tiny_qwen3_fp32, capsys):
    rc = main(["run", "--model", str(tiny_qwen3_fp32), "--prompt", "Once upon a time", "--temperature", "0",
               "--ignore-eos", "--max-model-len", "40"])
    prompt_len = len(LLM(tiny_qwen3_fp32).encode("Once upon a time"))
    assert rc == 0 and f"[{40 - prompt_len} tokens, length;" in capsys.readouterr().err


def test_a_prompt_that_fills_the_context_is_a_one_line_error(tiny_qwen3_fp32, capsys):
    assert main(["run", "--model", str(tiny_qwen3_fp32), "--prompt", "word " * 40, "--max-model-len", "16"]) == 2
    err = capsys.readouterr().err
    assert "exceeds the context of 16 tokens" in err and err.count("\n") == 1


def test_run_prints_the_engine_choices_to_stderr(tiny_qwen3_fp32, capsys):
    rc = main(["run", "--model", str(tiny_qwen3_fp32), "--prompt", "Hi", "--max-new-tokens", "2", "--expert-backend", "torch"])
    out, err = capsys.readouterr()
    assert rc == 0 and "choices:" not in out
    line = err.splitlines()[0]  # the same line as bench's, before the completion's summary
    assert line.startswith("choices:    device cpu, expert_backend torch, gpu_memory_budget none")
    assert line.endswith("cuda_graph off")


def test_run_with_a_seed_is_reproducible(tiny_qwen3_fp32, capsys):
    argv = ["run", "--model", str(tiny_qwen3_fp32), "--prompt", "Hello", "--max-new-tokens", "8", "--seed", "3",
            "--top-k", "50", "--top-p", "0.9"]
    outputs = []
    for _ in range(2):
        assert main(argv) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("extra, needle", [
    (["--temperature", "-1"], "temperature must be 0 (greedy) or in [0.01, 100]"),
    (["--temperature", "1e-40"], "temperature must be 0 (greedy) or in [0.01, 100], got 1e-40"),
    (["--repetition-penalty", "1e-300"], "repetition_penalty must be in [0.01, 100]"),
    (["--top-k", "1000000000000000000000000000000"], "top_k must be an integer in [0, 2147483647]"),
    (["--max-new-tokens", "5000"], "exceeds the context of 512 tokens"),
    (["--max-num-seqs", "0"], "max_num_seqs must be at least 1"),
    (["--max-model-len", "1024"],
     "max_model_len 1024 (--max-model-len) exceeds the model's max_position_embeddings 512"),
])
def test_mistakes_are_one_line_errors(tiny_qwen3_fp32, capsys, extra, needle):
    assert main(["run", "--model", str(tiny_qwen3_fp32), "--prompt", "Hi", *extra]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.startswith("hybridmoe run: error:") and err.count("\n") == 1


def test_engine_flags_map_onto_engine_config_fields():
    from dataclasses import fields

    from hybridmoe.cli import build_parser
    from hybridmoe.commands.engine_args import engine_kwargs
    from hybridmoe.config import EngineConfig
    args = build_parser().parse_args(["run", "--model", "m", "--prompt", "p", "--max-model-len", "256",
                                      "--dtype", "bfloat16", "--expert-backend", "native"])
    assert engine_kwargs(args) == {"max_model_len": 256, "dtype": "bfloat16", "expert_backend": "native"}
    help_text = build_parser()._subparsers._group_actions[0].choices["run"].format_help()
    for f in fields(EngineConfig):
        assert "--" + f.name.replace("_", "-") in help_text


def _edit_config(tiny_qwen3_fp32, tmp_path, edit):
    d = tmp_path / "model"
    shutil.copytree(tiny_qwen3_fp32, d)
    config = json.loads((d / "config.json").read_text())
    edit(config)
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_max_model_len_up_to_the_model_positions_or_its_default(tiny_qwen3_fp32):
    assert LLMEngine(tiny_qwen3_fp32, EngineConfig(max_model_len=512)).max_model_len == 512
    assert LLMEngine(tiny_qwen3_fp32).max_model_len == 512  # max_position_embeddings: the cache holds more


def test_max_model_len_of_a_config_without_max_position_embeddings(tiny_qwen3_fp32, tmp_path):
    d = _edit_config(tiny_qwen3_fp32, tmp_path, lambda c: c.pop("max_position_embeddings"))
    assert LLMEngine(d, EngineConfig(max_model_len=1024)).max_model_len == 1024
    assert LLMEngine(d).max_model_len == 32768  # the family's default, which the cache (8 x 4096 tokens) holds
    # a smaller cache: as many tokens as it holds, and a max_model_len it cannot hold is an error
    assert LLMEngine(d, EngineConfig(max_num_seqs=2)).max_model_len == 8192
    small = LLMEngine(d, EngineConfig(kv_cache_budget=64 << 10))
    c = small.model_config  # keys and values of every layer's KV heads, float32
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4
    assert small.kv_plan.bytes_per_token == per_token
    assert small.max_model_len == (64 << 10) // (per_token * 64) * 64
    with pytest.raises(HybridMoEError, match="max_model_len 4096 needs .* raise --kv-cache-budget"):
        LLMEngine(d, EngineConfig(kv_cache_budget=64 << 10, max_model_len=4096))


def test_max_model_len_may_reach_what_yarn_stretches_the_model_to(tiny_qwen3_fp32, tmp_path):
    d = _edit_config(tiny_qwen3_fp32, tmp_path, lambda c: c.update(
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}))
    assert LLMEngine(d, EngineConfig(max_model_len=2048)).max_model_len == 2048
    with pytest.raises(HybridMoEError, match="exceeds the model's max_position_embeddings 2048"):
        LLMEngine(d, EngineConfig(max_model_len=2049))


def test_a_kv_cache_beyond_the_host_memory_is_refused_before_it_is_allocated(tiny_qwen3_fp32):
    with pytest.raises(HybridMoEError, match=r"the KV cache needs .* of host memory .* lower --kv-cache-budget"):
        LLMEngine(tiny_qwen3_fp32, EngineConfig(kv_cache_budget=1 << 50))


def test_the_default_host_tier_is_the_gpu_cache_at_most_half_the_available_memory(tiny_qwen3_fp32):
    from hybridmoe.kv_plan import plan_kv_cache
    from hybridmoe.models.registry import load_config

    _, config = load_config(tiny_qwen3_fp32)
    gpu = EngineConfig(device="cpu")
    gpu.device = "cuda"  # the plan only reads the name: no GPU needed to plan for one
    plan = plan_kv_cache(config, gpu, 1000)
    assert plan.host_blocks == plan.num_blocks - 1  # as large as the device's cache
    assert plan_kv_cache(config, gpu, 1000, host_available=64 * 1000 * 10).host_blocks == 5  # half of 10 blocks
    assert plan_kv_cache(config, EngineConfig(device="cpu"), 1000).host_blocks == 0  # the cache is host memory
    assert plan_kv_cache(config, EngineConfig(device="cpu", kv_cpu_budget=64 * 1000 * 3), 1000).host_blocks == 3
