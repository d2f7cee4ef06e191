"""`benchmarks/prefill.py profile` on the CPU device: both modes of a tiny model profiled, each part where
it runs (the streamed share only with streaming on, the CPU engine only with it off)."""

import json

import pytest

from benchmarks import prefill
from hybridmoe.platform import native_engine_built

pytestmark = pytest.mark.skipif(not native_engine_built(), reason="streaming needs the native engine")


def _mean_row(text: str, title: str) -> dict[str, float]:
    """The 'mean' row of the table under the title line that starts with `title`, by column name."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    head = [c.strip() for c in lines[start + 1].strip("|").split("|")]
    mean = next(line for line in lines[start:] if line.startswith("| mean |"))
    return dict(zip(head[1:], (float(c) for c in mean.strip("|").split("|")[1:])))


def test_streaming_on_and_off_put_the_experts_time_where_they_ran(capsys, tmp_path):
    out = tmp_path / "profile.json"
    argv = ["profile", "--synthetic", "qwen3_moe:tiny", "--layers", "1", "--prompt-lens", "24", "--reps", "1",
            "--top-ops", "0", "--cold", "--device", "cpu", "--dtype", "bfloat16", "--expert-backend", "native",
            "--expert-format", "int8", "--gpu-experts-per-layer", "1", "--json", str(out)]
    assert prefill.main(argv) == 0
    text = capsys.readouterr().out
    on = _mean_row(text, "## int8, 24 tokens, streaming on")
    off = _mean_row(text, "## int8, 24 tokens, streaming off")
    assert on["streamed share"] > 0 and on["stream math"] > 0 and on["copy"] > 0 and on["CPU experts"] == 0
    assert off["CPU experts"] > 0 and off["streamed share"] == 0 and off["copy"] == 0
    assert off["GPU-expert share"] > 0 and on["GPU-expert share"] == 0  # streamed: in the streamer's math
    for row in (on, off):
        assert row["layer"] >= row["attention"] + row["MoE block"] > 0
    results = json.loads(out.read_text())["results"]
    assert [(r["format"], r["tokens"], r["streaming"]) for r in results] == [("int8", 24, "on"), ("int8", 24, "off")]
    assert results[0]["layers_ms"][0]["copy"] > 0 and results[1]["layers_ms"][0]["CPU experts"] > 0
