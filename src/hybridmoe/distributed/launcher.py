"""Rank 0's side of a tensor-parallel group: it starts the N - 1 worker processes, joins the group with them, waits
for their shards to load, hands them each model call in lockstep, and stops them.

Each worker is `python -m hybridmoe.distributed.worker FD`, a fresh interpreter (not a fork of this process, whose
threads and CUDA context a fork would copy; and not multiprocessing's spawn, which imports the caller's main
module again, so a script without an `if __name__ == "__main__"` guard would start workers from its workers, and
which leaves its resource-tracker process behind). FD is its end of a socket pair to rank 0: WorkerArgs and then
the messages go over it (distributed/messages.py), the tensors over the process group.

A worker's failure surfaces on rank 0 as a HybridMoEError naming the rank and its reason: while it starts or
loads (rank 0 waits on its pipe, which closes if it dies), or in a step (the collective fails as the group loses
it; a worker that hangs fails it after COLLECTIVE_TIMEOUT). The group is then broken: every later call is refused
at once. close() (LLM.close, or the LLM's garbage collection, or the interpreter's exit) stops the workers (Stop,
then a kill past STOP_SECONDS) and leaves the group; a worker whose rank 0 dies sees its pipe close and exits.

On the CPU every rank runs torch with its share of the host's cores (cores // N threads; rank 0 too while the group
runs): the ranks compute at the same time, and more threads than cores make each parallel region wait for threads
the scheduler has put aside. Rank 0's routed experts run in the native engine's own threads, while the workers wait.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch

from hybridmoe.config import EngineConfig
from hybridmoe.distributed.checks import check_model_splits
from hybridmoe.distributed.messages import RankReport, Stop, WorkerArgs, rank_report
from hybridmoe.distributed.parallel_state import TensorParallel, join_group, leave_group
from hybridmoe.errors import HybridMoEError

STOP_SECONDS = 30.0
"""How long close() waits for a worker to exit after Stop before it kills it (unless _Processes.kill_at_once)."""

FAILURE_SECONDS = 2.0
"""How long a failed step waits for a worker to say why (or to exit) before it takes rank 0's own error as the
cause."""


@dataclass
class _Worker:
    rank: int
    process: subprocess.Popen
    conn: Connection

    def receive(self, during: str):
        """The value of the worker's next message; a HybridMoEError if it failed or exited instead (`during`: what
        it was doing, for the message)."""
        try:
            kind, value = self.conn.recv()
        except (EOFError, OSError):
            raise HybridMoEError(f"tensor-parallel rank {self.rank} exited (code {self.process.wait()}) {during}") \
                from None
        if kind == "error":
            raise HybridMoEError(f"tensor-parallel rank {self.rank} failed {during}: {value}")
        return value


@dataclass
class _Processes:
    """What close() stops; held apart from TensorParallelWorkers so that its finalizer does not keep that alive."""

    workers: list[_Worker] = field(default_factory=list)
    tmp: Path | None = None
    joined: bool = False
    kill_at_once: bool = False
    """The workers may never read Stop: a step failed (a worker may wait in one of its collectives), or the group
    closes before its shards are all loaded (a worker may be loading for minutes)."""
    torch_threads: int | None = None
    """Rank 0's torch threads before the group took its share of the cores (given back when it stops)."""

    def stop(self) -> None:
        for w in self.workers:
            try:
                w.conn.send(Stop())
            except OSError:  # already gone
                pass
        for w in self.workers:
            try:
                w.process.wait(timeout=0 if self.kill_at_once else STOP_SECONDS)
            except subprocess.TimeoutExpired:  # not reading Stop (in a collective, or loading): killed
                w.process.kill()
                w.process.wait()
            w.conn.close()
        if self.joined:
            leave_group()
        if self.torch_threads is not None:
            torch.set_num_threads(self.torch_threads)
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


class TensorParallelWorkers:
    """The workers of a group of engine_config.tensor_parallel_size ranks, this process rank 0 (start())."""

    def __init__(self, processes: _Processes):
        self._processes = processes
        self._close = weakref.finalize(self, processes.stop)
        self.group: TensorParallel | None = None
        """Rank 0's place in the group, once joined."""
        self.reports: list[RankReport] = []
        """What each rank holds, rank 0 first, once every shard is loaded (wait_ready)."""
        self._broken: str | None = None

    @classmethod
    def start(cls, model_dir: Path, engine_config: EngineConfig, load: Callable) -> TensorParallelWorkers:
        """Check that model_dir's model splits, start the workers (each loads its shard with load), and join the
        group with them; rank 0 then loads its own shard and calls wait_ready."""
        world = engine_config.tensor_parallel_size
        check_model_splits(model_dir, world)
        processes = _Processes(tmp=Path(tempfile.mkdtemp(prefix="hybridmoe-tp-")))
        workers = cls(processes)
        try:
            threads = max(1, len(os.sched_getaffinity(0)) // world)  # each rank's share of the cores
            for rank in range(1, world):
                args = WorkerArgs(rank, world, processes.tmp / "init", Path(model_dir), engine_config, load, threads)
                processes.workers.append(_spawn(args))
            for w in processes.workers:
                w.receive("while it started")
            workers.group = join_group(0, world, processes.tmp / "init", torch.device(engine_config.device))
            processes.joined = True
            if workers.group.device.type == "cpu":  # the ranks compute at once: more threads than cores stall them
                processes.torch_threads = torch.get_num_threads()
                torch.set_num_threads(threads)
        except BaseException:
            workers.close()
            raise
        return workers

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self._processes.workers]

    def wait_ready(self, model: torch.nn.Module) -> None:
        """Wait for every worker's shard to load (rank 0's, model, is loaded); a HybridMoEError if one fails."""
        try:
            loaded = [w.receive("while it loaded its shard") for w in self._processes.workers]
            self.reports = [rank_report(model, 0), *loaded]
        except BaseException:
            self.close()
            raise

    @contextmanager
    def in_lockstep(self, message) -> Iterator[None]:
        """Send message to every worker, then run the block (rank 0's same call); a failure there that a worker
        caused is raised as that worker's HybridMoEError, and any failure breaks the group."""
        if self._broken is not None:
            raise HybridMoEError(f"the tensor-parallel group stopped ({self._broken}); make a new LLM")
        try:
            for w in self._processes.workers:
                w.conn.send(message)
            yield
        except BaseException as e:
            self._processes.kill_at_once = True
            failure = self._worker_failure()
            self._broken = str(failure or f"rank 0: {type(e).__name__}")
            if failure is None:
                raise
            raise failure from e

    def _worker_failure(self) -> HybridMoEError | None:
        """The first worker's reason to have failed (its error message, or its exit), if one has within
        FAILURE_SECONDS."""
        conns = {w.conn: w for w in self._processes.workers}
        for conn in wait(list(conns), timeout=FAILURE_SECONDS):
            try:
                conns[conn].receive("in a step")
            except HybridMoEError as e:
                return e
        return None

    def close(self) -> None:
        """Stop the workers and leave the group (once; later calls do nothing)."""
        self._broken = self._broken or "closed"
        self._processes.kill_at_once |= not self.reports
        self._close()


def _spawn(args: WorkerArgs) -> _Worker:
    ours, theirs = socket.socketpair()
    package_root = str(Path(__file__).resolve().parents[2])  # where hybridmoe is imported from here
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    with theirs:
        process = subprocess.Popen([sys.executable, "-m", "hybridmoe.distributed.worker", str(theirs.fileno())],
                                   pass_fds=(theirs.fileno(),), env=env)
    conn = Connection(ours.detach())
    conn.send(args)
    return _Worker(args.rank, process, conn)
