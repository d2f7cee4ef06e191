from types import SimpleNamespace

import pytest

from benchmarks.lib.peers_compare import comparison_lines, llama_figures, our_figures
from benchmarks.lib.peers_llama_bench import parse_llama_bench

LLAMA = """[{"n_prompt": 64, "n_gen": 0, "avg_ts": 76911.837785, "stddev_ts": 4736.500012, "n_cpu_moe": 2},
            {"n_prompt": 0, "n_gen": 16, "avg_ts": 10026.532279, "stddev_ts": 57.707871, "n_cpu_moe": 2}]"""


def test_our_repetitions_become_llama_bench_tests_without_the_warm_up():
    result = SimpleNamespace(prefill_samples={64: [10.0, 100.0, 300.0]}, decode_samples_s=[1.0, 0.01, 0.02])
    ours = our_figures("ours", result, gen_len=16, floor_tok_s=200.0, gpu_share=0.0, placement="none")
    assert ours.samples == {"pp64": [100.0, 300.0], "tg16": [100.0, 50.0]}
    assert ours.tok_s == {"pp64": 200.0, "tg16": 75.0}
    assert ours.stddev["pp64"] == pytest.approx(141.42, abs=0.01)


def test_the_table_sets_each_test_side_by_side_with_the_ratio_and_the_decode_floors():
    theirs = llama_figures("llama.cpp Q4_K_M", parse_llama_bench(LLAMA), 20000.0, 0.0, 2)
    ours = our_figures("ours", SimpleNamespace(prefill_samples={64: [1.0, 153823.7, 153823.7]},
                                               decode_samples_s=[1.0, 1e-4, 1e-4]),
                       16, 30000.0, 0.0, "0 GPU experts per MoE layer")
    lines = comparison_lines("every routed expert on the CPU", theirs, ours)
    assert lines[1] == ("# GPU share of the routed-expert bytes: llama.cpp Q4_K_M 0.00 (-ncmoe 2), ours 0.00 "
                        "(0 GPU experts per MoE layer)")
    pp, tg = (line.split("|")[1:-1] for line in lines[4:6])
    assert [c.strip() for c in pp] == ["pp64", "76911.8 ± 4736.5", "153823.7 ± 0.0", "2.00", "-", "-"]
    assert [c.strip() for c in tg] == ["tg16", "10026.5 ± 57.7", "10000.0 ± 0.0", "1.00", "20000.0", "30000.0"]
