"""One model forward for a scheduled batch: build the step context, run, sample.

Shapes: T new tokens of all sequences (flattened), B scheduled sequences, N of them sampled,
H hidden, V vocabulary.

On CUDA, when the experts can run without host syncs (HybridExperts.use_fixed_shapes: native CPU
experts, or none), a decode step (one token per sequence, B <= max_num_seqs) runs in fixed
shapes: the batch padded to a bucket of Bp rows (padding rows use a spare KV-cache slot), every
row attending over one padded length Lp, inputs in static device buffers. With cuda_graph, the
step for each (Bp, Lp) is captured once as a CUDA graph (lazily, after one eager warm-up run)
and replayed; without, the same fixed-shape step runs eagerly, so both give the same tokens.
Prefill and everything else runs eagerly in the shapes of the batch.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from hybridmoe.engine.context import Context, DecodeBatch, use_context
from hybridmoe.engine.sampler import Sampler, TokenLogprobs, token_logprobs
from hybridmoe.engine.scheduler import ScheduledSeq

SMALL_BATCHES = 8
"""Batch sizes up to this get a bucket each (a padding row computes its own routed experts);
larger ones are padded to a multiple of it."""

MIN_PAD_LEN = 64
"""Shortest padded attention length; above it, the next power of two."""


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_slots: int, max_len: int, device: torch.device,
                 cuda_graph: bool = False, fixed_shapes: bool | None = None):
        """cuda_graph: capture and replay decode steps (CUDA only). fixed_shapes: run decode steps in
        fixed shapes; None: on CUDA when the experts allow it; True also runs them so on the CPU."""
        self.model = model
        self.device = torch.device(device)
        self.sampler = Sampler()
        self.num_slots, self.max_len = num_slots, max_len
        if fixed_shapes is None:
            use_fixed = getattr(model.experts, "use_fixed_shapes", None)
            fixed_shapes = (self.device.type == "cuda" and use_fixed is not None
                            and use_fixed(num_slots, model.lm_head.weight.dtype))
        self.fixed = fixed_shapes
        model.allocate_kv_cache(num_slots + 1 if self.fixed else num_slots, max_len)  # + the padding rows' slot
        self.cuda_graph = self.fixed and cuda_graph and self.device.type == "cuda"
        if self.fixed:
            self._ids, self._positions, self._slots, self._lens = (
                torch.zeros(num_slots, dtype=torch.long, device=self.device) for _ in range(4))
            self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
            self._pool = None

    @property
    def captured(self) -> list[tuple[int, int]]:
        """(rows, padded length) of each decode step captured as a CUDA graph so far."""
        return sorted(self._graphs) if self.cuda_graph else []

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> tuple[list[int | None], list[TokenLogprobs | None]]:
        """The next token of every sequence whose tokens are all computed after this step, else None;
        and its log-probabilities where the sequence's SamplingParams.logprobs asks for them."""
        decode = bool(self.fixed and batch and all(s.num_tokens == 1 and s.completes for s in batch))
        # the step's thread off the CPU expert pools' CPUs while it launches and waits (HybridExperts)
        decode_thread = getattr(self.model.experts, "decode_thread", None) if decode else None
        with decode_thread() if decode_thread is not None else nullcontext():
            return self._step(batch, decode)

    def _step(self, batch: list[ScheduledSeq], decode: bool) -> tuple[list[int | None], list[TokenLogprobs | None]]:
        if decode:
            logits = self._run_decode(batch)
            rows = list(range(len(batch)))
        else:
            logits, rows = self._run_eager(batch)
        tokens: list[int | None] = [None] * len(batch)
        logprobs: list[TokenLogprobs | None] = [None] * len(batch)
        if rows:
            seqs = [batch[b].seq for b in rows]
            wanted = [j for j, s in enumerate(seqs) if s.params.logprobs is not None]
            raw = logits[wanted] if wanted else None  # a copy: the sampler penalizes logits in place
            sampled = self.sampler(logits, seqs)
            for b, t in zip(rows, sampled):
                tokens[b] = t
            if wanted:
                found = token_logprobs(raw, [sampled[j] for j in wanted], [seqs[j].params.logprobs for j in wanted])
                for j, lp in zip(wanted, found):
                    logprobs[rows[j]] = lp
        check = getattr(self.model.experts, "check", None)
        if self.fixed and check is not None:
            check()  # errors of CPU layers run on the CUDA stream (the sampler synchronized)
        return tokens, logprobs

    def _run_eager(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor | None, list[int]]:
        """Logits [N, V] float32 of the sequences that complete, and their rows in batch."""
        ids, positions, cu_seqlens = [], [], [0]
        for s in batch:
            start = s.seq.num_computed
            ids += s.seq.token_ids(start, start + s.num_tokens)
            positions += range(start, start + s.num_tokens)
            cu_seqlens.append(len(ids))
        ctx = Context(slot_ids=[s.seq.slot for s in batch], start_pos=[s.seq.num_computed for s in batch],
                      cu_seqlens=cu_seqlens)
        with use_context(ctx):
            hidden = self.model(torch.tensor(ids, dtype=torch.long, device=self.device),
                                torch.tensor(positions, dtype=torch.long, device=self.device))  # [T, H]
        # Only the last token of a sequence that finishes its prompt (or decodes) yields a token.
        rows = [b for b, s in enumerate(batch) if s.completes]
        if not rows:
            return None, rows
        last = torch.tensor([cu_seqlens[b + 1] - 1 for b in rows], device=self.device)
        return self.model.compute_logits(hidden[last]), rows

    def _run_decode(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """A decode step in fixed shapes (a graph replay with cuda_graph): logits [B, V] float32."""
        B = len(batch)
        Bp = B if B <= SMALL_BATCHES else min(-(-B // SMALL_BATCHES) * SMALL_BATCHES, self.num_slots)
        lens = [s.seq.num_computed + 1 for s in batch]
        pad_len = min(self.max_len, max(MIN_PAD_LEN, 1 << (max(lens) - 1).bit_length()))
        pad = Bp - B  # padding rows: token 0 at position 0 of the spare slot
        ids = [s.seq.token_ids(s.seq.num_computed, s.seq.num_computed + 1)[0] for s in batch] + [0] * pad
        host = torch.tensor([ids, [n - 1 for n in lens] + [0] * pad,
                             [s.seq.slot for s in batch] + [self.num_slots] * pad, lens + [1] * pad])  # [4, Bp]
        for buf, row in zip((self._ids, self._positions, self._slots, self._lens), host):
            buf[:Bp].copy_(row)
        if not self.cuda_graph:
            return self._forward_fixed(Bp, pad_len)[:B]
        key = (Bp, pad_len)
        if key not in self._graphs:
            self._graphs[key] = self._capture(Bp, pad_len)
        graph, logits = self._graphs[key]
        graph.replay()
        return logits[:B].clone()

    def _forward_fixed(self, Bp: int, pad_len: int) -> torch.Tensor:
        """The model over the static buffers' first Bp rows -> logits [Bp, V] float32."""
        ctx = Context(slot_ids=[], start_pos=[], cu_seqlens=[0],
                      decode=DecodeBatch(self._slots[:Bp], self._lens[:Bp], pad_len))
        with use_context(ctx):
            return self.model.compute_logits(self.model(self._ids[:Bp], self._positions[:Bp]))

    def _capture(self, Bp: int, pad_len: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # The warm-up computes this step eagerly (writing the keys the replay writes again, the same
        # values), so lazily created state (cuBLAS handles, the handoff's argument packs) exists
        # before capture, where no allocation outside the graph's pool may happen.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward_fixed(Bp, pad_len)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward_fixed(Bp, pad_len)
        return graph, logits
