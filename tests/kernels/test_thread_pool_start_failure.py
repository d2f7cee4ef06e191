"""A pool whose threads the system refuses (issue #25): the native ThreadPool stops and joins the
threads it had started and raises, so the process gets a one-line error naming the thread count
instead of an abort (std::terminate, SIGABRT); afterwards a pool that fits still starts.

The refusal is real: a child process lowers RLIMIT_NPROC to two threads above what its user runs
now. Root is exempt from that limit, so a child started as root first becomes the unprivileged
user 65534 (after its imports; then it is alone under that user id).
"""

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from hybridmoe.config import EngineConfig
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.cpu_experts import MAX_THREADS, CpuExperts, _native

E, H, I = 2, 64, 32

CHILD = textwrap.dedent(f"""
    import os, resource, time
    import torch
    from hybridmoe import CpuExperts
    from hybridmoe.errors import HybridMoEError
    from hybridmoe.experts.cpu_experts import _native

    torch.set_num_threads(1)
    native = _native()
    w = (torch.zeros({E}, {I}, {H}), torch.zeros({E}, {I}, {H}), torch.zeros({E}, {H}, {I}))
    if os.geteuid() == 0:
        os.setgid(65534)
        os.setuid(65534)

    def user_threads():
        # what RLIMIT_NPROC counts: every thread of every process of this real user id
        n = 0
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{{pid}}/status") as f:
                    uid = next(line for line in f if line.startswith("Uid:")).split()[1]
                if int(uid) == os.getuid():
                    n += len(os.listdir(f"/proc/{{pid}}/task"))
            except (OSError, StopIteration):
                pass
        return n

    def own_threads():
        return len(os.listdir("/proc/self/task"))

    before = own_threads()
    hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    resource.setrlimit(resource.RLIMIT_NPROC, (user_threads() + 2, hard))
    try:
        CpuExperts(*w, threads=64)
        print("STARTED")
    except HybridMoEError as e:
        print("EXPERTS", e)
    try:
        native._pool_help_check(64, 1, 1, False)
        print("STARTED")
    except RuntimeError as e:
        print("POOL", e)
    for _ in range(1000):  # a joined thread leaves /proc/self/task as the kernel reaps it
        if own_threads() <= before:
            break
        time.sleep(0.01)
    print("THREADS", before, own_threads())
    experts = CpuExperts(*w, threads=2)
    out = experts.forward(torch.randn(3, {H}), torch.tensor([[0, 1]] * 3), torch.rand(3, 2))
    print("FITS", tuple(out.shape))
""")


@pytest.fixture(scope="module")
def child():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", CHILD], check=False, capture_output=True, text=True, env=env,
                          timeout=300)


def lines(child, tag):
    return [line[len(tag) + 1:] for line in child.stdout.splitlines() if line.startswith(tag + " ")]


def test_the_process_exits_normally(child):
    assert child.returncode != -signal.SIGABRT, child.stderr
    assert child.returncode == 0, child.stderr
    assert "terminate called" not in child.stderr
    assert "STARTED" not in child.stdout


def test_cpu_experts_raise_one_line_naming_the_thread_count(child):
    (msg,) = lines(child, "EXPERTS")
    assert msg.startswith("could not start a CPU pool of 64 threads: the system refused thread ")
    assert "ulimit -u" in msg


def test_a_pool_built_directly_raises_runtime_error_naming_the_thread_count(child):
    (msg,) = lines(child, "POOL")
    assert msg.startswith("could not start a CPU pool of 64 threads")


def test_the_threads_started_before_the_refusal_are_joined(child):
    # none is left running, so a pool of two threads starts under the same limit afterwards
    (counts,) = lines(child, "THREADS")
    before, after = map(int, counts.split())
    assert after <= before
    assert lines(child, "FITS") == [f"(3, {H})"]


def test_threads_past_the_cap_are_refused_before_the_engine():
    w = (torch.zeros(E, I, H), torch.zeros(E, I, H), torch.zeros(E, H, I))
    with pytest.raises(HybridMoEError, match=rf"^threads must be between 1 and {MAX_THREADS}, got 1500 \(this "
                                             r"process may use \d+ CPUs\)$"):
        CpuExperts(*w, threads=1500)


def test_the_cap_is_the_native_engines_and_the_configs():
    assert _native().max_threads == MAX_THREADS
    assert EngineConfig(cpu_threads=MAX_THREADS).cpu_threads == MAX_THREADS
    with pytest.raises(HybridMoEError, match=f"^cpu_threads must be between 1 and {MAX_THREADS}, got 1500$"):
        EngineConfig(cpu_threads=1500)
    with pytest.raises(ValueError, match=f"^threads must be between 1 and {MAX_THREADS}, got {MAX_THREADS + 1}$"):
        _native().MoeEngine(E, H, I, "bf16", 128, False, MAX_THREADS + 1, "", 1, False)
