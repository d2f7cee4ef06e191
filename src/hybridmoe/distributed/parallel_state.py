"""One process's place in a tensor-parallel group: its rank, the world size, its device, and the collectives the
sharded layers run over torch.distributed's default process group.

The group is gloo on the CPU and NCCL on CUDA (one GPU per rank: rank r computes on cuda:r). Its members meet
through a file store (an init file in a temporary directory rank 0 makes), so no port is fixed: gloo and NCCL pick
their own. Every collective runs under COLLECTIVE_TIMEOUT: a rank that stops answering fails the others' step after it
instead of hanging them; one that exits (crashes) fails it at once (gloo and NCCL see the connection close).

A process takes part in one group at a time (torch.distributed has one default group): join_group refuses a second.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from hybridmoe.errors import HybridMoEError

COLLECTIVE_TIMEOUT = timedelta(minutes=5)
"""Longest a rank waits in one collective (the rendezvous included) for the others: far above a step's longest
wait (rank 0's routed experts of a long prefill chunk, which the other ranks wait for), far below a hang's."""


@dataclass(frozen=True)
class TensorParallel:
    """This process's rank among world_size, and the collectives over the group it joined (join_group).

    Made without joining (rank and world size only), it serves what needs no collective: sharding a model built on
    the meta device (the launcher's checks before any worker starts)."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def owns_routed_experts(self) -> bool:
        """Rank 0 holds and runs every routed expert; the other ranks receive their output (distributed/experts.py)."""
        return self.rank == 0

    def part(self, size: int, what: str) -> int:
        """size // world_size: this rank's share of size (heads, rows); a size the world size does not divide is a
        one-line error naming `what`."""
        if size % self.world_size:
            raise HybridMoEError(f"tensor_parallel_size {self.world_size} does not divide {what} ({size}); "
                                 f"pick a tensor_parallel_size that divides it")
        return size // self.world_size

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's tensor, in place (contiguous tensor)."""
        dist.all_reduce(tensor)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's tensor [..., n] side by side in rank order along the last dimension: [..., world_size n]."""
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor)
        return torch.cat(parts, dim=-1)

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's tensor, in place on every rank (contiguous tensor, the same shape and dtype everywhere)."""
        dist.broadcast(tensor, src=0)
        return tensor


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def check_not_in_group() -> None:
    """A one-line error if this process already takes part in a group."""
    if dist.is_initialized():
        raise HybridMoEError("this process already takes part in a tensor-parallel group (one LLM with "
                             "tensor_parallel_size > 1 at a time per process); close the other LLM first")


def join_group(rank: int, world_size: int, init_file: Path, device: torch.device) -> TensorParallel:
    """Join the group of world_size processes that meet at init_file (a path no earlier group used) as rank."""
    check_not_in_group()
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(backend_for(device), init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    return TensorParallel(rank, world_size, device)


def leave_group() -> None:
    """Leave the group this process joined, if any (local: the other ranks leave on their own)."""
    if dist.is_initialized():
        dist.destroy_process_group()
