"""/metrics is Prometheus text and moves with the traffic: requests, tokens, batch sizes,
time to first token, inter-token latency, HTTP answers by route and status."""

import re


def test_metrics_move_with_a_request(server):
    before = {name: server.metric(name) for name in (
        "prompt_tokens_total", "generation_tokens_total", "engine_steps_total", "batch_size_count",
        "time_to_first_token_seconds_count", "inter_token_latency_seconds_count")}
    ok = server.metric("http_requests_total", 'route="/v1/completions",status="200"')
    finished = server.metric("requests_finished_total", 'finish_reason="length"')
    r = server.client().completions.create(model="tiny", prompt="count me", max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})
    after = {name: server.metric(name) for name in before}
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == r.usage.prompt_tokens
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == 6
    assert after["engine_steps_total"] - before["engine_steps_total"] >= 6
    assert after["batch_size_count"] - before["batch_size_count"] >= 6
    assert after["time_to_first_token_seconds_count"] - before["time_to_first_token_seconds_count"] == 1
    assert after["inter_token_latency_seconds_count"] - before["inter_token_latency_seconds_count"] == 5
    assert server.metric("http_requests_total", 'route="/v1/completions",status="200"') == ok + 1
    assert server.metric("requests_finished_total", 'finish_reason="length"') == finished + 1
    assert server.metric("requests_running") == 0 and server.metric("requests_waiting") == 0


def test_metrics_are_prometheus_text(server):
    code, raw = server.get("/metrics")
    text = raw.decode()
    assert code == 200
    sample = re.compile(r'^hybridmoe_[a-z_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? -?[0-9.e+-]+$')
    for line in text.splitlines():
        assert line.startswith(("# HELP hybridmoe_", "# TYPE hybridmoe_")) or sample.match(line), line
    for name, kind in [("requests_waiting", "gauge"), ("time_to_first_token_seconds", "histogram"),
                       ("inter_token_latency_seconds", "histogram"), ("batch_size", "histogram"),
                       ("generation_tokens_total", "counter")]:
        assert f"# TYPE hybridmoe_{name} {kind}" in text
    # histogram buckets are cumulative and end at the count
    buckets = [float(v) for v in re.findall(r'^hybridmoe_batch_size_bucket\{le="[^"]+"\} (\S+)$', text, re.M)]
    assert buckets == sorted(buckets) and buckets[-1] == server.metric("batch_size_count")
