import pytest

from benchmarks.lib.peers_llama_bench import llama_bench_command, parse_llama_bench
from hybridmoe.errors import HybridMoEError

# llama-bench -m tiny-Q4_K_M.gguf -ngl 99 -ncmoe 2 -t 2 -p 64 -n 16 -r 2 -o json (a CPU-only build), fields cut
SAMPLE = """[
  {
    "build_commit": "0c1e570", "build_number": 588, "cpu_info": "AMD EPYC", "gpu_info": "", "backends": "CPU",
    "model_filename": "models/qwen3_moe-tiny-2L-seed0-Q4_K_M.gguf", "model_type": "qwen3moe ?B Q4_K - Medium",
    "model_size": 157184, "model_n_params": 189824, "n_batch": 2048, "n_ubatch": 512, "n_threads": 2,
    "n_gpu_layers": 99, "n_cpu_moe": 2, "flash_attn": -1, "n_prompt": 64, "n_gen": 0, "n_depth": 0,
    "test_time": "2026-12-07T11:23:41Z", "avg_ns": 461422, "stddev_ns": 18387,
    "avg_ts": 138811.43579, "stddev_ts": 5524.165828,
    "samples_ns": [ 474407, 448438 ],
    "samples_ts": [ 134905, 142718 ]
  },
  {
    "build_commit": "0c1e570", "build_number": 588, "cpu_info": "AMD EPYC", "gpu_info": "", "backends": "CPU",
    "model_filename": "models/qwen3_moe-tiny-2L-seed0-Q4_K_M.gguf", "model_type": "qwen3moe ?B Q4_K - Medium",
    "model_size": 157184, "model_n_params": 189824, "n_batch": 2048, "n_ubatch": 512, "n_threads": 2,
    "n_gpu_layers": 99, "n_cpu_moe": 2, "flash_attn": -1, "n_prompt": 0, "n_gen": 16, "n_depth": 0,
    "test_time": "2026-12-07T11:23:41Z", "avg_ns": 755665, "stddev_ns": 1305,
    "avg_ts": 21173.393124, "stddev_ts": 12.303749,
    "samples_ns": [ 755355, 755976 ],
    "samples_ts": [ 21182.1, 21164.7 ]
  }
]
"""


def test_each_test_becomes_a_row_under_llama_benchs_own_label():
    pp, tg = parse_llama_bench(SAMPLE)
    assert (pp.test, pp.tokens, tg.test, tg.tokens) == ("pp64", 64, "tg16", 16)
    assert pp.tok_s == pytest.approx(138811.43579) and pp.stddev_tok_s == pytest.approx(5524.165828)
    assert tg.samples_tok_s == (21182.1, 21164.7)
    assert (tg.n_cpu_moe, tg.threads, tg.backends, tg.build_commit) == (2, 2, "CPU", "0c1e570")


@pytest.mark.parametrize("text", ["", "llama-bench: error: failed to load model", "[]", "{}"])
def test_output_that_holds_no_test_is_an_error(text):
    with pytest.raises(HybridMoEError, match="llama-bench"):
        parse_llama_bench(text)


def test_the_command_keeps_every_layer_on_the_gpu_but_the_first_ncmoe_blocks_experts():
    cmd = llama_bench_command("llama-bench", "m.gguf", 16, [512, 8192], 64, 3, 48)
    assert cmd[0] == "llama-bench"
    pairs = dict(zip(cmd[1::2], cmd[2::2]))
    assert pairs == {"-m": "m.gguf", "-ngl": "99", "-ncmoe": "48", "-t": "16", "-p": "512,8192", "-n": "64",
                     "-r": "3", "-o": "json"}
