"""What `hybridmoe serve` checks before it loads the model, and prints before it listens."""

import socket

import hybridmoe.engine.llm_engine
from hybridmoe.cli import main


def test_a_taken_port_is_a_one_line_error_before_the_model_loads(tiny_qwen3_fp32, capsys, monkeypatch):
    loads = []
    load_model = hybridmoe.engine.llm_engine.load_model
    monkeypatch.setattr(hybridmoe.engine.llm_engine, "load_model", lambda *a, **k: loads.append(a) or load_model(*a, **k))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        rc = main(["serve", "--model", str(tiny_qwen3_fp32), "--port", str(port), "--dtype", "float32"])
    err = capsys.readouterr().err
    assert rc == 2 and loads == []
    assert err.startswith("hybridmoe serve: error: cannot listen on 127.0.0.1:") and err.count("\n") == 1
    assert f"port {port}" in err and "--port" in err


def test_the_engine_choices_are_printed_before_the_server_listens(server):
    lines = server.log_path.read_text().splitlines()  # the real server's stdout and stderr
    choices = [i for i, line in enumerate(lines) if line.startswith("choices:")]
    serving = [i for i, line in enumerate(lines) if line.startswith("serving ")]
    assert len(choices) == 1 and len(serving) == 1 and choices[0] < serving[0]
    assert lines[choices[0]].startswith("choices:    device cpu, expert_backend ")  # the line bench prints
