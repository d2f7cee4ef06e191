import json

import pytest

from hybridmoe.cli import main


def test_bench_prints_choices_and_table_and_writes_json(tiny_qwen3_fp32, tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    rc = main(["bench", "--model", str(tiny_qwen3_fp32), "--prompt-len", "16", "--gen-len", "5", "--batch", "2",
               "--seed", "1", "--json", str(out_json), "--expert-backend", "torch"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "choices:    device cpu, expert_backend torch, gpu_memory_budget none" in out and "cuda_graph off" in out
    assert "batch 2 x prompt 16 + gen 5" in out
    for row in ("prefill", "decode", "TTFT mean / max", "load", "peak RSS"):
        assert f"\n  {row} " in out
    data = json.loads(out_json.read_text())
    assert data["setup"]["prompt_len"] == 16 and data["setup"]["gen_len"] == 5 and data["setup"]["batch"] == 2
    result = data["result"]
    assert result["generated_tokens"] == 2 * 5  # greedy, EOS ignored: every request runs gen_len tokens
    assert result["prefill_tok_s"] > 0 and result["decode_tok_s"] > 0 and result["load_s"] > 0


@pytest.mark.parametrize("flag", ["--gen-len", "--prompt-len", "--batch"])
def test_a_non_positive_workload_is_a_one_line_error(tiny_qwen3_fp32, capsys, flag):
    assert main(["bench", "--model", str(tiny_qwen3_fp32), flag, "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridmoe bench: error:") and err.count("\n") == 1
    assert f"{flag} 1 or more" in err


def test_a_workload_over_the_context_names_the_flags(tiny_qwen3_fp32, capsys):
    assert main(["bench", "--model", str(tiny_qwen3_fp32), "--prompt-len", "500", "--gen-len", "100",
                 "--expert-backend", "torch"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hybridmoe bench: error:") and err.count("\n") == 1
    assert "--prompt-len 500 + --gen-len 100 = 600 exceeds the model's context of 512 tokens" in err
    assert "max_tokens" not in err
