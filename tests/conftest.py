"""Everything outside tests/device is the CPU suite, the one CI runs on a machine without a GPU. On a machine
with one it still runs on the CPU ("auto" resolves to it), so that its CPU references and expectations hold
there too; tests marked `device` (tests/device) are the ones that test the GPU."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _cpu_suite_sees_no_gpu(request, monkeypatch):
    if request.node.get_closest_marker("device") is None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
