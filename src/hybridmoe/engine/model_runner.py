"""One model forward for a scheduled batch: build the step context, run, sample.

Shapes: T new tokens of all sequences (flattened), B scheduled sequences, N of them sampled,
H hidden, V vocabulary.

The KV cache is paged (engine/kv_blocks.py): the runner keeps the block table on the device, one row per
slot, and writes a sequence's row where its blocks changed before the step that reads them.

On CUDA, when the experts can run without host syncs (HybridExperts.use_fixed_shapes: native CPU
experts, or none), a decode step (one token per sequence, B <= max_num_seqs) runs in fixed
shapes: the batch padded to a bucket of Bp rows (padding rows use a spare slot, whose row of the
block table points at the scratch block), every row attending over one padded length Lp, inputs
and the block table in static device buffers. With cuda_graph, the
step for each (Bp, Lp) is captured once as a CUDA graph (lazily, after one eager warm-up run)
and replayed; without, the same fixed-shape step runs eagerly, so both give the same tokens.
Prefill and everything else runs eagerly in the shapes of the batch.

A model with a recurrent state per sequence (Gated DeltaNet layers, models/base.py state_bytes_per_seq) keeps its
states in one row per slot, allocated here beside the KV blocks, and runs fixed-shape decode steps (and their graphs)
too: the step reads and rewrites its rows' states in place by slot, the slots being a static device input
(DecodeBatch), so a replay continues whatever the slots hold. Its padding rows use the spare slot num_slots, as in the
block table, so the states get num_slots + 1 slots (the prefix snapshots' rows after them). What a step does on the
host for the states (copying restored snapshots into slots and checking each row continues its slot before it;
advancing the slots' positions and keeping the saved snapshots after it: DeltaNetState.begin_step, end_decode_step)
runs here around the launch, since a replay runs no Python. Capturing a graph runs the step once eagerly first, which
would advance the batch's states: their rows are copied before that warm-up and written back after it, so the replay
that follows computes the step from the states as they were. No step is launched ahead for such a model (lookahead is
off): one dropped would have advanced the states; the step still takes its greedy tokens on the device.

With sample_on_device, a fixed-shape step also takes each row's greedy token (the argmax of its
logits) and writes the next step's inputs in place (that token, position and length + 1), on the
device. For a batch of plain greedy rows (no penalties, no logprobs) the host then reads back only
the tokens (one pinned copy) and copies no inputs when the device already holds them; and (with
lookahead) the next step is launched before this step's tokens are read, so the host's share of a
step (the read back, the engine's Python, the launch) runs while the device computes the next one.
A step launched ahead whose batch does not come (a sequence stopped at EOS, a request arrived) is
dropped: it ran on its own KV-cache positions only, which the next writes there replace. The
decode thread stays pinned (HybridExperts.decode_thread) while steps are in flight.

Greedy rows held to a grammar (structured output) take the same path: while the device computes a step, the host
computes those rows' token masks from their matchers (which have consumed every token before the step's), and
enqueues, after the step, the masked argmax of those rows into the next step's inputs, then the read back of the
tokens, then the next step. So the mask's time and the host's share of a step both run while the device works;
the matchers consume the tokens once they are read.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass

import torch

from hybridmoe.config import DEFAULT_KV_BLOCK_SIZE
from hybridmoe.engine.grammar import advance
from hybridmoe.engine.kv_blocks import SCRATCH_BLOCK, BlockCopy
from hybridmoe.engine.sampler import Sampler, TokenLogprobs, token_logprobs
from hybridmoe.engine.scheduler import LOOKAHEAD_TOKENS, ScheduledSeq
from hybridmoe.engine.sequence import Sequence
from hybridmoe.forward_context import Context, DecodeBatch, use_context
from hybridmoe.sampling_params import SamplingParams

SMALL_BATCHES = 8
"""Batch sizes up to this get a bucket each (a padding row computes its own routed experts);
larger ones are padded to a multiple of it."""

MIN_PAD_LEN = 64
"""Shortest padded attention length; above it, the next power of two."""


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_slots: int, max_len: int, device: torch.device,
                 cuda_graph: bool = False, fixed_shapes: bool | None = None, num_blocks: int | None = None,
                 block_size: int = DEFAULT_KV_BLOCK_SIZE, host_blocks: int = 0, kv_fp8: bool = False,
                 num_snapshots: int = 0):
        """cuda_graph: capture and replay decode steps (CUDA only). fixed_shapes: run decode steps in
        fixed shapes; None: on CUDA when the experts allow it; True also runs them so on the CPU.
        num_blocks: the KV cache's blocks of block_size positions (None: num_slots sequences of max_len).
        host_blocks: the host tier's blocks (engine/kv_blocks.py), in pinned memory on CUDA. kv_fp8: the cache in
        float8 (layers/kv_quant.py). num_snapshots: recurrent-state snapshots beside the slots, for prefix caching
        (engine/state_snapshots.py; a model with a recurrent state only)."""
        self.model = model
        self.device = torch.device(device)
        self.sampler = Sampler()
        self.num_slots, self.max_len = num_slots, max_len
        recurrent = model.state_bytes_per_seq() > 0
        if fixed_shapes is None:
            fixed_shapes = (self.device.type == "cuda"
                            and model.experts.use_fixed_shapes(num_slots, model.lm_head.weight.dtype))
        self.fixed = fixed_shapes
        self.block_size = block_size
        per_seq = -(-(max_len + LOOKAHEAD_TOKENS) // block_size)  # blocks of the longest sequence and its lookahead
        model.allocate_kv_blocks(1 + num_slots * per_seq if num_blocks is None else num_blocks, block_size,
                                 quantized=kv_fp8)
        # a fixed-shape step's padding rows compute on the spare slot num_slots (the module docstring)
        model.allocate_state(num_slots + 1 if self.fixed else num_slots, num_snapshots)
        self._states = model.recurrent_states() if recurrent else []
        # a row per slot and one for the padding rows (all SCRATCH_BLOCK)
        self.block_table = torch.full((num_slots + 1, per_seq), SCRATCH_BLOCK, dtype=torch.int32, device=self.device)
        self._rows: list[tuple[object, int]] = [(None, 0)] * num_slots  # per slot: whose blocks, how many written
        pin = self.device.type == "cuda"
        self._host_kv = [torch.zeros(host_blocks, *t.shape[1:], dtype=t.dtype, pin_memory=pin)
                         for t in model.kv_cache_tensors()] if host_blocks else []
        self.cuda_graph = self.fixed and cuda_graph and self.device.type == "cuda"
        # Both on by default: Qwen3-30B-A3B int4 decode at batch 1 takes 948 us/token (4 layers) against 1179.
        self.sample_on_device = True
        """Plain greedy decode steps read back only the step's own argmax, and copy no inputs the device holds
        (a graph captured the other way is captured again at its next step)."""
        self.lookahead = not recurrent
        """With sample_on_device, launch the next decode step before reading this one's tokens (never for a model
        with a recurrent state: a step dropped would have advanced it)."""

        self._holds: list[list[int]] | None = None  # what _inputs hold once the steps enqueued ran, if known
        self._ahead: _Launched | None = None  # the next decode step, launched before this one's tokens were read
        self._pinned: ExitStack | None = None  # the decode thread's pinning, held while steps are in flight
        if self.fixed:
            cuda = self.device.type == "cuda"
            # [4, S] long, rows: token ids, positions, KV-cache slots, cached lengths after the step
            self._inputs = torch.zeros(4, num_slots, dtype=torch.long, device=self.device)
            self._ids, self._positions, self._slots, self._lens = self._inputs
            self._staged = torch.zeros(4, num_slots, dtype=torch.long, pin_memory=cuda)  # host side of _inputs
            self._read = [torch.zeros(num_slots, dtype=torch.long, pin_memory=cuda) for _ in range(2)]  # tokens back
            self._flip = 0  # which _read the next step writes (a step ahead and the one before it use both)
            self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, bool]] = {}
            self._retired: list[tuple] = []  # graphs captured with sample_on_device the other way (_graph)
            self._pool = None

    @property
    def captured(self) -> list[tuple[int, int]]:
        """(rows, padded length) of each decode step captured as a CUDA graph so far."""
        return sorted(self._graphs) if self.cuda_graph else []

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq],
            lookahead: bool = False) -> tuple[list[int | None], list[TokenLogprobs | None]]:
        """The next token of every sequence whose tokens are all computed after this step, else None;
        and its log-probabilities where the sequence's SamplingParams.logprobs asks for them.
        lookahead: the caller schedules the same sequences next unless one finishes (no request waits
        to be admitted), so the next decode step may be launched before this one's tokens are read."""
        self._write_block_table([s.seq for s in batch])
        decode = bool(self.fixed and batch and all(s.num_tokens == 1 and s.completes for s in batch))
        if not decode:
            self.settle()
            logits, rows = self._run_eager(batch)
            out = self._sample(batch, logits, rows)
            if self.fixed:
                self._check()  # (short steps run their CPU layers on the stream too; the sampler synchronized)
            return out
        if self._pinned is None:
            # the step's thread off the CPU expert pools' CPUs while steps are in flight (HybridExperts)
            self._pinned = ExitStack()
            self._pinned.enter_context(self.model.experts.decode_thread())
        try:
            return self._run_decode(batch, lookahead)
        finally:
            if self._ahead is None:
                self.settle()

    def settle(self) -> None:
        """Drop a step launched ahead (its tokens are never read) and unpin the thread: when no step follows."""
        if self._ahead is not None:
            self._ahead, self._holds = None, None  # it advanced the inputs past what _holds says
        if self._pinned is not None:
            self._pinned, pinned = None, self._pinned
            pinned.close()

    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Make the host tier's copies (BlockPool.copies) in order, each run of one direction at once: a device
        block's keys and values into a host block ("out", before the block is reused), or back ("in")."""
        for direction, run in itertools.groupby(copies, key=lambda c: c.direction):
            run = list(run)
            device_blocks = torch.tensor([c.device_block for c in run], device=self.device)
            host_blocks = torch.tensor([c.host_block for c in run])
            for cache, host in zip(self.model.kv_cache_tensors(), self._host_kv):
                if direction == "out":
                    host[host_blocks] = cache[device_blocks].cpu()
                else:
                    cache[device_blocks] = host[host_blocks].to(self.device)

    def _write_block_table(self, seqs: list[Sequence]) -> None:
        """The device block table's rows of seqs, where their blocks changed since it was last written: the
        blocks added to a row's sequence, or the whole row of a sequence new to its slot."""
        rows, cols, blocks = [], [], []
        for seq in seqs:
            owner, written = self._rows[seq.slot]
            table = seq.blocks.table
            start = written if owner is seq.blocks else 0
            if start < len(table):
                rows += [seq.slot] * (len(table) - start)
                cols += range(start, len(table))
                blocks += table[start:]
                self._rows[seq.slot] = (seq.blocks, len(table))
        if rows:
            self.block_table[torch.tensor(rows, device=self.device), torch.tensor(cols, device=self.device)] = \
                torch.tensor(blocks, dtype=torch.int32, device=self.device)

    def _sample(self, batch: list[ScheduledSeq], logits: torch.Tensor | None,
                rows: list[int]) -> tuple[list[int | None], list[TokenLogprobs | None]]:
        """Tokens (and logprobs) of batch's rows `rows` from their logits [len(rows), V] by the sampler."""
        tokens: list[int | None] = [None] * len(batch)
        logprobs: list[TokenLogprobs | None] = [None] * len(batch)
        if rows:
            seqs = [batch[b].seq for b in rows]
            wanted = [j for j, s in enumerate(seqs) if s.params.logprobs is not None]
            raw = logits[wanted] if wanted else None  # a copy: the sampler penalizes logits in place
            sampled, failed = self.sampler.sample(logits, seqs)
            for j, why in failed.items():
                seqs[j].error = f"sampling failed: {why}"  # this sequence ends alone (LLMEngine)
            for b, t in zip(rows, sampled):
                tokens[b] = t
            kept = [k for k, j in enumerate(wanted) if j not in failed]  # raw's rows of sampled sequences
            if kept:
                found = token_logprobs(raw[kept], [sampled[wanted[k]] for k in kept],
                                       [seqs[wanted[k]].params.logprobs for k in kept])
                for k, lp in zip(kept, found):
                    logprobs[rows[wanted[k]]] = lp
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
                      cu_seqlens=cu_seqlens, block_table=self.block_table,
                      first_blocks=[_consecutive_from(s.seq.blocks.table) for s in batch], **_snapshot_steps(batch))
        with use_context(ctx):
            hidden = self.model(torch.tensor(ids, dtype=torch.long, device=self.device),
                                torch.tensor(positions, dtype=torch.long, device=self.device))  # [T, H]
        # Only the last token of a sequence that finishes its prompt (or decodes) yields a token.
        rows = [b for b, s in enumerate(batch) if s.completes]
        if not rows:
            return None, rows
        last = torch.tensor([cu_seqlens[b + 1] - 1 for b in rows], device=self.device)
        return self.model.compute_logits(hidden[last]), rows

    def _run_decode(self, batch: list[ScheduledSeq],
                    lookahead: bool = False) -> tuple[list[int], list[TokenLogprobs | None]]:
        """A decode step in fixed shapes (a graph replay with cuda_graph): each sequence's token and logprobs."""
        B = len(batch)
        Bp = B if B <= SMALL_BATCHES else min(-(-B // SMALL_BATCHES) * SMALL_BATCHES, self.num_slots)
        lens = [s.seq.num_computed + 1 for s in batch]
        pad = Bp - B  # padding rows: token 0 at position 0 of the spare slot
        inputs = [[s.seq.token_ids(s.seq.num_computed, s.seq.num_computed + 1)[0] for s in batch] + [0] * pad,
                  [n - 1 for n in lens] + [0] * pad, [s.seq.slot for s in batch] + [self.num_slots] * pad,
                  lens + [1] * pad]  # [4, Bp]
        on_device = self.sample_on_device and all(_device_greedy(s.seq.params) for s in batch)
        held = [b for b, s in enumerate(batch) if s.seq.matcher is not None]  # rows held to a grammar
        step, self._ahead = self._ahead, None
        states = self._host_context(batch) if self._states else None  # no step ahead: this one launches here
        for state in self._states:
            state.begin_step(states)
        if step is None or step.inputs != inputs or (held and step.read is not None):
            if step is not None:
                self._holds = None  # the step ahead is dropped, but it advanced the inputs
            step = self._launch(inputs, Bp, read=on_device and not held)
        for state in self._states:
            state.end_decode_step(states)
        if not on_device:
            self._holds = None  # the step's own argmax (its next ids) may not be the sampler's tokens
            tokens, logprobs = self._sample(batch, step.logits[:B].clone(), list(range(B)))
        else:
            if held:
                self._hold_to_grammars(step, [batch[b].seq.matcher for b in held], held, Bp)
            ahead = None
            if (self.lookahead and lookahead and pad == 0 and not self._states
                    and all(len(s.seq.output_ids) + 1 < s.seq.params.max_tokens
                            and len(s.seq.blocks.table) * self.block_size >= s.seq.num_computed + 2 for s in batch)):
                ahead = self._launch(None, Bp, read=not held, lens=[n + 1 for n in lens])
            tokens = step.tokens()
            # after the step the device holds its tokens and the next positions (after the ahead, the ones after)
            self._holds = [tokens, [p + 1 for p in inputs[1]], inputs[2], [n + 1 for n in inputs[3]]]
            if ahead is not None:
                ahead.inputs, self._ahead, self._holds = self._holds, ahead, None
            tokens, logprobs = tokens[:B], [None] * B
            for b in held:
                if (why := advance(batch[b].seq.matcher, tokens[b])) is not None:
                    batch[b].seq.error, tokens[b] = f"sampling failed: {why}", None  # it ends alone (LLMEngine)
        self._check()
        return tokens, logprobs

    @staticmethod
    def _host_context(batch: list[ScheduledSeq]) -> Context:
        """A decode step's batch as the host sees it, for its recurrent states' host share (the module docstring):
        the real rows' slots and positions, and their snapshots to restore and to save."""
        return Context(slot_ids=[s.seq.slot for s in batch], start_pos=[s.seq.num_computed for s in batch],
                       cu_seqlens=list(range(len(batch) + 1)), **_snapshot_steps(batch))

    def _hold_to_grammars(self, step: _Launched, matchers: list, rows: list[int], Bp: int) -> None:
        """Enqueue, after step, the argmax of its logits' `rows` with every token their matchers forbid masked,
        into the next step's input ids (where the step wrote its own argmax), then the read back of its tokens."""
        n = len(rows)
        index = slice(0, n) if rows == list(range(n)) else torch.tensor(
            rows, pin_memory=self.device.type == "cuda").to(self.device, non_blocking=True)
        logits = step.logits[index]  # the rows' logits: a view of the step's, or a copy of them
        self.sampler.grammars.mask(logits, list(enumerate(matchers)))
        self._ids[index] = logits.argmax(dim=-1)
        self._read_back(step, Bp)

    def _check(self) -> None:
        """Raise what CPU layers run on the CUDA stream recorded (after the step's results were waited for)."""
        self.model.experts.check()

    def _launch(self, inputs: list[list[int]] | None, Bp: int, read: bool,
                lens: list[int] | None = None) -> _Launched | None:
        """Enqueue a decode step of Bp rows on inputs [4, Bp] (None: on what the device holds, the rows'
        lengths then `lens`); read: copy its greedy tokens back. None (nothing launched) when inputs is
        None and the step's graph is not captured yet (capturing runs a step eagerly first)."""
        lens = inputs[3] if inputs is not None else lens
        pad_len = min(self.max_len, max(MIN_PAD_LEN, 1 << (max(lens) - 1).bit_length()))
        key = (Bp, pad_len)
        if self.cuda_graph and inputs is None and self._graph(key, capture=False) is None:
            return None
        if inputs is not None and inputs != self._holds:
            self._staged[:, :Bp] = torch.tensor(inputs)
            self._inputs.copy_(self._staged, non_blocking=True)  # whole (one copy): rows past Bp are not read
        if not self.cuda_graph:
            logits = self._forward_fixed(Bp, pad_len)
        else:
            graph, logits, _ = self._graph(key, capture=True)
            graph.replay()
        step = _Launched(inputs, logits)
        if read:
            self._read_back(step, Bp)
        return step

    def _read_back(self, step: _Launched, Bp: int) -> None:
        """Enqueue the copy of step's greedy tokens to the host (the step wrote them as the next input ids)."""
        step.read = self._read[self._flip][:Bp]
        self._flip ^= 1
        step.read.copy_(self._ids[:Bp], non_blocking=True)
        if self.device.type == "cuda":
            step.done = torch.cuda.Event()  # spun on: waiting asleep (blocking) decodes 1.04x slower
            step.done.record()
            step.wait = self.model.experts.wait_step

    def _graph(self, key: tuple[int, int], capture: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, bool] | None:
        """(graph, its logits, whether it samples on the device) of the decode step of key (rows, padded
        length) as sample_on_device is now: captured anew if it changed since (the old graph is kept: its
        memory pool is shared); None if there is none and not capture."""
        entry = self._graphs.get(key)
        if entry is not None and entry[2] != self.sample_on_device:
            self._retired.append(self._graphs.pop(key))
            entry = None
        if entry is None and capture:
            entry = self._graphs[key] = (*self._capture(*key), self.sample_on_device)
        return entry

    def _forward_fixed(self, Bp: int, pad_len: int) -> torch.Tensor:
        """The model over the static buffers' first Bp rows -> logits [Bp, V] float32; with
        sample_on_device, the buffers then hold the next step's inputs: each row's greedy token at the
        next position, one more cached."""
        ctx = Context(slot_ids=[], start_pos=[], cu_seqlens=[0],
                      decode=DecodeBatch(self._slots[:Bp], self._lens[:Bp], pad_len), block_table=self.block_table)
        with use_context(ctx):
            logits = self.model.compute_logits(self.model(self._ids[:Bp], self._positions[:Bp]))
        if self.sample_on_device:
            torch.argmax(logits, dim=-1, out=self._ids[:Bp])
            self._inputs[1::2, :Bp] += 1  # positions and lens
        return logits

    def _capture(self, Bp: int, pad_len: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # The warm-up computes this step eagerly (writing the keys the replay writes again, the same
        # values), so lazily created state (cuBLAS handles, the handoff's argument packs) exists
        # before capture, where no allocation outside the graph's pool may happen.
        # The warm-up would also advance the rows' recurrent states (this step's, which the replay computes next):
        # their rows are copied before it and written back after it.
        inputs = self._inputs.clone()  # the warm-up may advance them, and the replay must see them as they are
        slots = self._slots[:Bp]
        states = [state.copy_rows(slots) for state in self._states]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            self._forward_fixed(Bp, pad_len)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        for state, rows in zip(self._states, states):
            state.put_rows(slots, rows)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward_fixed(Bp, pad_len)
        self._inputs.copy_(inputs)
        return graph, logits


@dataclass
class _Launched:
    """A fixed-shape decode step enqueued on the device."""

    inputs: list[list[int]] | None
    """The [4, Bp] rows it runs on (ids, positions, slots, lens); for a step launched ahead, known once the
    step before it has its tokens read."""
    logits: torch.Tensor
    """[Bp, V] float32 (a graph's output: valid until the graph's next replay)."""
    read: torch.Tensor | None = None
    """[Bp] long: its greedy tokens, copied back (pinned on CUDA)."""
    done: torch.cuda.Event | None = None
    """Recorded after that copy (CUDA)."""
    wait: Callable[[torch.cuda.Event], None] | None = None
    """How to wait for done: the experts backend's wait_step (set with done)."""

    def tokens(self) -> list[int]:
        if self.done is not None:
            self.wait(self.done)
        return self.read.tolist()


def _snapshot_steps(batch: list[ScheduledSeq]) -> dict[str, list[tuple[int, ...]]]:
    """The step context's state_restores and state_saves for batch's recurrent-state snapshots."""
    return {"state_restores": [(s.seq.slot, s.restore) for s in batch if s.restore is not None],
            "state_saves": [(b, n, snapshot) for b, s in enumerate(batch) for n, snapshot in s.saves]}


def _consecutive_from(table: list[int]) -> int | None:
    """table's first block when its blocks are consecutive (b, b + 1, ...), else None."""
    return table[0] if table and table[-1] - table[0] == len(table) - 1 and table == list(
        range(table[0], table[0] + len(table))) else None


def _device_greedy(p: SamplingParams) -> bool:
    """Greedy with nothing that needs the logits on the host: the step's own argmax is the token, masked by the
    row's grammar when it has one."""
    return (p.greedy and p.logprobs is None and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0
            and p.frequency_penalty == 0.0)
