import json
from types import SimpleNamespace

import pytest
import torch

from benchmarks import e2e as entry
from benchmarks.lib import e2e, e2e_suite
from benchmarks.lib.cli import parser
from hybridmoe.bench.anatomy import step_anatomy
from hybridmoe.bench.fit import depth_fits
from hybridmoe.bench.synthetic import full_config
from hybridmoe.config import EngineConfig
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts import packed_gpu
from hybridmoe.experts.placement import model_footprint
from hybridmoe.models.registry import architecture_of, get_model_class


def parse_args(argv: list[str]):
    """The e2e command line as the subcommand sees it, the suite's settings and the defaults filled in."""
    args = parser("e2e.py", "", entry.COMMANDS).parse_args(argv)
    return e2e_suite.fill(args) if args.command == "suite" else e2e.fill_defaults(args)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One ablation run of tiny Qwen3 cut to 1 of its 2 layers, everything on the CPU."""
    out = tmp_path_factory.mktemp("e2e") / "e2e.json"
    argv = ["run", "--synthetic", "qwen3_moe:tiny", "--layers", "1", "--prompt-lens", "16,32", "--gen-len", "4",
            "--decode-prompt-len", "8", "--ablation", "--device", "cpu", "--dtype", "bfloat16",
            "--expert-backend", "native", "--expert-format", "bf16", "--bandwidth-bytes", str(16 << 20),
            "--json", str(out)]
    return argv, out


def test_ablation_runs_every_configuration_and_the_json_carries_the_floor(report, capsys):
    argv, out = report
    assert entry.main(argv) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    labels = [r["label"] for r in data["results"]]
    assert labels == ["bf16 all on", "bf16 no CUDA graph", "bf16 deferral 1", "bf16 no GPU experts"]
    engines = {r["label"]: r["engine"] for r in data["results"]}
    assert engines["bf16 all on"]["deferred_experts"] == 0 and engines["bf16 deferral 1"]["deferred_experts"] == 1
    assert engines["bf16 no CUDA graph"]["cuda_graph"] is False
    assert engines["bf16 no GPU experts"]["gpu_experts_per_layer"] == 0
    # the host read probed before the first load and after each (all on with no CUDA graph; deferral 1; no GPU
    # experts): each row's floor at the higher of the probes around its load
    probes = data["setup"]["bandwidth_probes_gbps"]
    assert len(probes) == 4
    around = [max(probes[i], probes[i + 1]) for i in (0, 0, 1, 2)]
    assert [r["floor"]["bandwidth_gbps"] for r in data["results"]] == pytest.approx(around)
    for r in data["results"]:
        floor = r["floor"]
        # 1 MoE layer, K=2 experts of 3 x 32 x 64 bf16 weights, all on the CPU
        assert floor["bytes_per_token"] == 2 * 3 * 32 * 64 * 2 and floor["bandwidth_gbps"] > 0
        assert r["decode_over_floor"] == pytest.approx(r["decode_s"] / floor["seconds"])
        assert r["full_depth"]["layers"] == 2  # cut from 2 layers: extrapolated
        assert r["full_depth"]["floor_s"] == pytest.approx(2 * floor["seconds"])
    assert set(data["results"][0]["prefill_tok_s"]) == {"16", "32"}  # the all-on row runs every length
    # each prompt's prefill timed per layer: full depth from the non-layer part + 2 layers at the MoE layer's time
    lt = data["results"][0]["prefill_layer_times"]["32"]
    full = 32 / ((lt["non_layer_s"] + 2 * lt["moe_layer_s"]) * data["results"][0]["ttft_s"]["32"] / lt["eager_step_s"])
    assert data["results"][0]["full_depth"]["prefill_tok_s"]["32"] == pytest.approx(full)
    assert "| bf16 no GPU experts |" in text and "extrapolated to 2 layers" in text
    assert "assumption: top-k routing" in text
    # peers are measured side by side by benchmarks/peers.py, never set against figures written in the code
    assert "llama" not in text.lower() and "llama_cpp" not in data["setup"]
    assert set(data["setup"]["targets"]) == {"decode_over_floor", "prefill2048_over_decode"}


def test_the_help_points_to_the_peers_benchmark(capsys):
    with pytest.raises(SystemExit):
        entry.main(["run", "--help"])
    assert "benchmarks/peers.py" in capsys.readouterr().out


def test_the_packed_row_unpacks_the_gpu_experts_of_int4_and_int8_only():
    loads = e2e.configurations({"gpu_memory_budget": 1 << 30}, ["int4", "bf16"], ["packed"])
    unpacked = [load for load in loads if load.label.endswith("GPU experts unpacked")]
    assert [load.label for load in unpacked] == ["int4 GPU experts unpacked"]
    assert unpacked[0].kwargs["gpu_experts_packed"] is False and unpacked[0].kwargs["expert_format"] == "int4"
    assert not any("unpacked" in load.label for load in e2e.configurations({}, ["bf16"], ["packed"]))


def test_bad_prompt_lengths_are_a_one_line_error(capsys):
    assert entry.main(["run", "--synthetic", "qwen3_moe:tiny", "--prompt-lens", "16,x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("e2e.py run: error: --prompt-lens") and err.count("\n") == 1


def test_a_suite_fills_the_issue_setup_and_keeps_what_the_user_gave():
    args = parse_args(["suite", "qwen3", "--gpu-memory-budget", "8GiB"])
    assert (args.synthetic, args.layers, args.formats, args.repeats) == ("qwen3-30b-a3b", "4,12", "int4,bf16", 3)
    assert args.model is None and args.ablation == "graph,trim,pin,help,ahead,deferral,gpu-experts,packed"
    assert args.deferral_rows == "1,2" and parse_args(["run", "--synthetic", "x"]).deferral_rows == "1"
    assert args.gpu_memory_budget == "8GiB"
    assert parse_args(["suite", "dsv3"]).gpu_memory_budget == "16GiB"
    small = parse_args(["suite", "dsv3", "--layers", "1", "--prompt-lens", "16", "--formats", "bf16"])
    assert (small.synthetic, small.layers, small.prompt_lens, small.formats, small.gen_len) == \
        ("deepseek-v3", "1", "16", "bf16", 16)
    plain = parse_args(["run", "--synthetic", "x"])
    assert (plain.prompt_lens, plain.gen_len, plain.repeats) == ("512,2048,8192", 32, 1)


def test_a_crashed_configuration_is_retried_with_streaming_off_then_skipped(monkeypatch, capsys):
    calls = []

    def flaky(label, model_dir, ec, lens, **kw):
        calls.append((label, ec.prefill_streaming, kw["eager_label"], kw["handoff_variants"]))
        if len(calls) == 1:
            raise RuntimeError("CUDA error: invalid argument\nmore")
        return ["rows"]

    run, load = e2e.run_configuration, e2e.Load
    monkeypatch.setattr(e2e, "run_suite", flaky)
    trim = (("int4 trim padding off", {"trim_padding": False}),)
    assert run("M", load("int4 all on", {"device": "cpu"}, "int4 no CUDA graph", trim), [16]) == ["rows"]
    assert calls == [("int4 all on", "auto", "int4 no CUDA graph", trim),
                     ("int4 all on (streaming off)", "off", "int4 no CUDA graph (streaming off)",
                      (("int4 trim padding off (streaming off)", {"trim_padding": False}),))]
    assert "int4 all on: FAILED (RuntimeError: CUDA error: invalid argument)" in capsys.readouterr().out
    monkeypatch.setattr(e2e, "run_suite", lambda *a, **k: 1 / 0)
    assert run("M", load("bf16", {"device": "cpu", "prefill_streaming": "off"}), [16]) == []  # no second try


def test_ablation_variants_come_after_every_format():
    every = e2e.ablation_rows("graph,zero-copy,trim,pin,help,prefetch,ahead,deferral,gpu-experts")
    runs = e2e.configurations({"gpu_memory_budget": "16GiB"}, ["int4", "bf16"], every)
    assert [(r.label, r.eager_label, r.handoff_variants, r.every_length) for r in runs] == [
        ("int4 all on", "int4 no CUDA graph", (("int4 zero-copy", {"zero_copy": True}),
                                               ("int4 trim padding", {"trim_padding": True}),
                                               ("int4 unpinned", {"pin_decode_thread": False}),
                                               ("int4 helping wait", {"help_decode_wait": True}),
                                               ("int4 next-layer prefetch", {"prefetch_next": True}),
                                               ("int4 step ahead", {"sample_on_device": True, "lookahead": True}),
                                               ("int4 all on, again", {})), True),
        ("bf16 all on", None, (), True), ("int4 no GPU experts", None, (), False)]
    assert [r.deferral_variants for r in runs] == [(("int4 deferral 1", 1),), (), ()]  # the hybrid split switches K
    kwargs = {r.label: r.kwargs for r in runs}
    assert kwargs["int4 all on"]["deferred_experts"] == 0 and kwargs["bf16 all on"]["deferred_experts"] == 0
    given = e2e.configurations({"deferred_experts": 2}, ["int4"], every)
    assert [(r.label, r.kwargs["deferred_experts"], r.deferral_variants) for r in given] == [
        ("int4 all on", 2, (("int4 no deferral", 0),)), ("int4 no GPU experts", 2, ())]
    assert kwargs["int4 no GPU experts"] == dict(kwargs["int4 all on"], gpu_experts_per_layer=0)
    # not the hybrid split (no budget, no GPU experts, K=0): K cannot be switched, the row loads its own engine
    plain = e2e.configurations({}, ["int4"], e2e.ablation_rows("deferral"))
    assert [(r.label, r.kwargs["deferred_experts"], r.every_length) for r in plain] == [
        ("int4 all on", 0, True), ("int4 deferral 1", 1, False)]
    two = e2e.configurations({"gpu_memory_budget": "16GiB"}, ["int4"], e2e.ablation_rows("deferral"), 1, (1, 2))
    assert [r.deferral_variants for r in two] == [(("int4 deferral 1", 1), ("int4 deferral 2", 2))]
    plain = e2e.configurations({}, ["int4"], e2e.ablation_rows("deferral"), 1, (1, 2))
    assert [(r.label, r.kwargs["deferred_experts"]) for r in plain] == [
        ("int4 all on", 0), ("int4 deferral 1", 1), ("int4 deferral 2", 2)]


def test_with_repeats_the_handoff_rows_have_no_all_on_again_row():
    rows = e2e.ablation_rows("graph,trim")
    (once,) = e2e.configurations({}, ["int4"], rows)
    (repeated,) = e2e.configurations({}, ["int4"], rows, repeats=3)
    assert [label for label, _ in once.handoff_variants] == ["int4 trim padding", "int4 all on, again"]
    assert [label for label, _ in repeated.handoff_variants] == ["int4 trim padding"]


def test_ablation_rows_can_be_chosen():
    runs = e2e.configurations({}, ["int4"], e2e.ablation_rows("graph"))
    assert [(r.label, r.eager_label, r.handoff_variants) for r in runs] == [("int4 all on", "int4 no CUDA graph", ())]
    every = "graph,zero-copy,trim,pin,help,prefetch,ahead,deferral,gpu-experts,packed"
    assert parse_args(["run", "--synthetic", "x", "--ablation"]).ablation == every
    with pytest.raises(HybridMoEError, match=f"--ablation takes rows among {every}, got graphs"):
        e2e.ablation_rows("graphs,trim")


def test_a_cut_model_gets_the_gpu_experts_per_layer_of_the_full_depth_plan():
    raw = full_config("qwen3_moe:tiny")  # 2 MoE layers of 8 experts
    kwargs = {"device": "cpu", "dtype": "bfloat16", "max_num_seqs": 1, "max_model_len": 64}
    cls = get_model_class(architecture_of(raw))
    fp = model_footprint(cls, cls.make_config(raw), torch.bfloat16, EngineConfig(**kwargs))
    per_layer, note = e2e.full_depth_gpu_experts(raw, dict(kwargs, gpu_memory_budget=fp.fixed_bytes
                                                              + 2 * 3 * fp.expert_bytes))
    assert per_layer == 3 and "3 GPU experts per MoE layer" in note
    per_layer, note = e2e.full_depth_gpu_experts(raw, dict(kwargs, gpu_memory_budget=fp.fixed_bytes - 1))
    assert per_layer == 0 and "does not fit the budget" in note


def test_the_full_depth_plan_counts_gpu_experts_packed_where_the_load_packs_them(monkeypatch):
    monkeypatch.setattr(packed_gpu, "HAVE_TRITON", True)
    raw = full_config("qwen3_moe:tiny")  # 2 MoE layers of 8 experts, 3 x 32 x 64 weights each
    kwargs = {"device": "cuda", "dtype": "bfloat16", "max_num_seqs": 1, "max_model_len": 64, "expert_backend": "native",
              "expert_format": "int4", "expert_group_size": 32}
    cls = get_model_class(architecture_of(raw))
    fp = model_footprint(cls, cls.make_config(raw), torch.bfloat16, EngineConfig(**kwargs))
    budget = fp.fixed_bytes + 2 * 2 * 3 * 32 * 64 * 2  # two bf16 experts a layer
    unpacked, _ = e2e.full_depth_gpu_experts(raw, dict(kwargs, gpu_memory_budget=budget, gpu_experts_packed=False))
    per_layer, note = e2e.full_depth_gpu_experts(raw, dict(kwargs, gpu_memory_budget=budget))
    assert unpacked == 2 and per_layer == 6 and "packed int4" in note  # int4 g32: 3.2x as many per byte


def test_two_depths_are_measured_in_turn_and_fitted(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    argv = ["run", "--synthetic", "qwen3_moe:tiny", "--layers", "1,2", "--prompt-lens", "16", "--gen-len", "4",
            "--decode-prompt-len", "8", "--device", "cpu", "--dtype", "bfloat16", "--expert-backend", "native",
            "--expert-format", "bf16", "--bandwidth-bytes", str(16 << 20), "--json", str(out)]
    assert entry.main(argv) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert [(r["label"], r["model_layers"]) for r in data["results"]] == [("bf16", 1), ("bf16", 2)]
    (fit,) = data["depth_fits"]
    assert fit["depths"] == [1, 2] and fit["full_layers"] == fit["full_moe_layers"] == 2
    # two depths: the line goes through both points, so full depth (2 layers) is the 2-layer measurement
    one, two = (r["decode_s"] for r in data["results"])
    assert fit["decode_fit"]["per_moe_layer_s"] == pytest.approx(two - one)
    assert fit["decode_s"] == pytest.approx(two)
    assert fit["prefill_tok_s"]["16"] == pytest.approx(data["results"][1]["prefill_tok_s"]["16"])
    assert "by a least-squares fit over the depths measured (1, 2 layers)" in text
    assert "[extrapolated to 2 layers by the fit over 1,2 layers]" in text


def test_layers_of_a_model_directory_are_an_error(capsys):
    assert entry.main(["run", "--model", "M", "--layers", "4"]) == 2
    assert "--layers cuts a --synthetic model" in capsys.readouterr().err


def test_anatomy_table_sets_each_layer_beside_its_floor():
    stats = dict(layers=40, cpu_us=40 * 200, late_us=40 * 0.5, steps=10, first_cpu_us=10 * 250,
                 first_late_us=10 * 2.0, gaps=30, between_us=30 * 100)
    floor = SimpleNamespace(per_moe_layer_seconds=lambda: 132e-6)
    row = SimpleNamespace(label="int4 all on", model_layers=4, floor=floor, anatomy=step_anatomy([stats], 2e-3))
    head, _, line = e2e.anatomy_table([row, SimpleNamespace(anatomy=None)])
    cells = dict(zip([c.strip() for c in head.split("|")], [c.strip() for c in line.split("|")]))
    assert (cells["CPU us/layer"], cells["floor us/layer"], cells["gap us/layer"]) == ("200.0", "132.0", "100.0")
    assert (cells["go late us"], cells["rest ms/token"]) == ("0.50", "0.900")


def test_with_repeats_the_fit_table_gives_the_full_depth_range_of_the_samples():
    def result(moe: int, samples: list[float]):
        floor = SimpleNamespace(layers=[None] * moe, per_moe_layer_seconds=lambda: 1e-4)
        return SimpleNamespace(label="int4 all on", model_layers=moe, decode_s=sorted(samples)[1],
                               decode_samples_s=samples, ttft_s={512: 0.1}, floor=floor)

    # one sample per depth, at 10 layers: (2, 2.4 ms) and (6, 1.6 ms) fit 0.8 ms, the fastest; (2, 1.2) and
    # (6, 3.2) 5.2 ms, the slowest; the medians (2, 1.5) and (6, 2.0) 2.5 ms, in between
    results = [result(2, [1.2e-3, 1.5e-3, 2.4e-3]), result(6, [1.6e-3, 2.0e-3, 3.2e-3])]
    (row,) = e2e.fit_table(depth_fits(results, 10, 10), [512], results)[2:]
    assert "| 192.3-1250.0 " in row and "| 400.0 " in row
