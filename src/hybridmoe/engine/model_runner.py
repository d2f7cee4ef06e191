"""One model forward for a scheduled batch: build the step context, run, sample.

Shapes: T new tokens of all sequences (flattened), B scheduled sequences, N of them sampled,
H hidden, V vocabulary.
"""

from __future__ import annotations

import torch

from hybridmoe.engine.context import Context, use_context
from hybridmoe.engine.sampler import Sampler, TokenLogprobs, token_logprobs
from hybridmoe.engine.scheduler import ScheduledSeq


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_slots: int, max_len: int, device: torch.device):
        self.model = model
        self.device = torch.device(device)
        self.sampler = Sampler()
        model.allocate_kv_cache(num_slots, max_len)

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq]) -> tuple[list[int | None], list[TokenLogprobs | None]]:
        """The next token of every sequence whose tokens are all computed after this step, else None;
        and its log-probabilities where the sequence's SamplingParams.logprobs asks for them."""
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
        tokens: list[int | None] = [None] * len(batch)
        logprobs: list[TokenLogprobs | None] = [None] * len(batch)
        if rows:
            last = torch.tensor([cu_seqlens[b + 1] - 1 for b in rows], device=self.device)
            logits = self.model.compute_logits(hidden[last])  # [N, V] float32
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
        return tokens, logprobs
