"""What `hybridmoe serve` checks before it loads the model."""

import socket

import uvicorn

import hybridmoe.weights.loader
from hybridmoe.cli import main


def test_a_taken_port_is_a_one_line_error_before_the_model_loads(tiny_model, capsys, monkeypatch):
    loads = []
    load_model = hybridmoe.weights.loader.load_model
    monkeypatch.setattr(hybridmoe.weights.loader, "load_model", lambda *a, **k: loads.append(a) or load_model(*a, **k))
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        rc = main(["serve", "--model", str(tiny_model), "--port", str(port), "--dtype", "float32"])
    err = capsys.readouterr().err
    assert rc == 2 and loads == []
    assert err.startswith("hybridmoe serve: error: cannot listen on 127.0.0.1:") and err.count("\n") == 1
    assert f"port {port}" in err and "--port" in err


def test_the_engine_choices_are_printed_before_the_server_listens(tiny_model, capsys, monkeypatch):
    stderr_when_listening = []
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: stderr_when_listening.append(capsys.readouterr().err))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["serve", "--model", str(tiny_model), "--port", str(port), "--dtype", "float32",
                 "--expert-backend", "torch"]) == 0
    [err] = stderr_when_listening
    line = err.splitlines()[0]  # the same line as bench's, before "serving ... on http://..."
    assert line.startswith("choices:    device cpu, expert_backend torch, gpu_memory_budget none")
    assert line.endswith("cuda_graph off") and err.splitlines()[1].startswith("serving ")
