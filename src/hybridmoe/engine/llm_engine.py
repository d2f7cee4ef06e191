"""The step loop: requests in, one scheduled batch per step, outputs out.

Meant to be driven directly by whoever serves requests: add_request() between steps (a request
joins the running batch at the next step), step() until has_unfinished() is false, abort() to
drop a request and free its KV-cache slot at once. Not thread-safe: drive it from one thread.

With tensor_parallel_size N > 1 this process is rank 0 of N (distributed/): it starts the workers before its own
load, drives its model through LockstepModel (each forward's batch goes to the workers, which run the model
only), and close() stops them.
"""

from __future__ import annotations

import itertools
import json
import threading
from pathlib import Path

from hybridmoe.config import EngineConfig
from hybridmoe.distributed.checks import tensor_parallel_options
from hybridmoe.distributed.launcher import TensorParallelWorkers
from hybridmoe.distributed.lockstep import LockstepModel
from hybridmoe.engine.detokenizer import Detokenizer
from hybridmoe.engine.grammar import Grammars
from hybridmoe.engine.kv_blocks import BlockPool
from hybridmoe.engine.model_loader import LoadedModel, load_model
from hybridmoe.engine.model_runner import ModelRunner
from hybridmoe.engine.sampler import TokenLogprobs
from hybridmoe.engine.scheduler import ScheduledSeq, Scheduler
from hybridmoe.engine.sequence import RequestOutput, Sequence
from hybridmoe.engine.state_snapshots import StateSnapshots
from hybridmoe.errors import HybridMoEError
from hybridmoe.kv_plan import plan_kv_cache
from hybridmoe.sampling_params import SamplingParams
from hybridmoe.system.host import meminfo
from hybridmoe.system.model_memory import check_kv_fits
from hybridmoe.tokenizer import Tokenizer
from hybridmoe.weights.gguf_model_dir import resolve_model_path


class LLMEngine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        if self.config.tensor_parallel_size > 1:
            self.config = tensor_parallel_options(self.config)
        model_dir = resolve_model_path(model_dir, self.config)  # a .gguf file -> its config/tokenizer directory
        self.model_dir = Path(model_dir)
        self.tensor_parallel: TensorParallelWorkers | None = None
        """The workers of a tensor-parallel group (tensor_parallel_size > 1), this engine rank 0."""
        loaded = self._load(self.model_dir)
        self.model_config = loaded.config
        self.random_weights = bool(loaded.config.get("hybridmoe_random_weights"))  # make-model's mark: noise text
        self.dtype = loaded.dtype
        self.resolved_config = loaded.engine_config  # self.config with "auto" as the load resolved it
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.vocab_size = loaded.config.vocab_size
        self.eos_token_ids = _eos_token_ids(Path(model_dir), loaded.config, self.tokenizer)
        state_bytes = loaded.model.state_bytes_per_seq()
        fp8 = self.config.kv_cache_dtype == "fp8"
        self.kv_plan = plan_kv_cache(loaded.config, self.config, loaded.model.kv_bytes_per_token(fp8), meminfo()[1],
                                     state_bytes)
        self.max_model_len = self.kv_plan.max_model_len
        check_kv_fits(self.kv_plan, self.config.device)
        # a recurrent state per sequence: a reused prefix also needs the state where it ends (engine/state_snapshots.py)
        snapshots = StateSnapshots(self.kv_plan.snapshots) if state_bytes and self.config.prefix_caching else None
        pool = BlockPool(self.kv_plan.num_blocks, self.kv_plan.block_size, self.config.prefix_caching,
                         self.kv_plan.host_blocks, snapshots)
        self.scheduler = Scheduler(self.config.max_num_seqs, self.config.max_num_batched_tokens, pool)
        model = loaded.model if self.tensor_parallel is None else LockstepModel(loaded.model, self.tensor_parallel)
        self.runner = ModelRunner(model, self.config.max_num_seqs, self.max_model_len,
                                  self.config.device, cuda_graph=self.config.cuda_graph,
                                  num_blocks=self.kv_plan.num_blocks, block_size=self.kv_plan.block_size,
                                  host_blocks=self.kv_plan.host_blocks, kv_fp8=fp8,
                                  num_snapshots=self.kv_plan.snapshots)
        self._requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()

    def _load(self, model_dir: Path) -> LoadedModel:
        if self.config.tensor_parallel_size == 1:
            return load_model(model_dir, self.config)
        self.tensor_parallel = TensorParallelWorkers.start(model_dir, self.config, load_model)
        try:
            loaded = load_model(model_dir, self.config, self.tensor_parallel.group)
        except BaseException:
            self.tensor_parallel.close()
            raise
        self.tensor_parallel.wait_ready(loaded.model)
        return loaded

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (the engine takes no step after); once is enough."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()

    def grammars(self) -> Grammars:
        """The vocabulary's grammar engine, built on first use (about a second for a 150K-token vocabulary); safe
        to call from any thread (a server checks requests' grammars on its prompt threads)."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise HybridMoEError("structured output needs the model's tokenizer, and this model directory "
                                         "has none")
                self._grammars = Grammars.build(self.tokenizer.to_json(), self.vocab_size, sorted(self.eos_token_ids))
                self.runner.sampler.grammars = self._grammars
            return self._grammars

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; it joins the batch at the next step. Returns its id."""
        params = params or SamplingParams()
        self._check_request(prompt_ids, params)
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._requests:
            raise HybridMoEError(f"request id {request_id!r} is already in use")
        detok = None
        if self.tokenizer is not None:
            detok = Detokenizer(self.tokenizer, prompt_ids, params.stop, params.skip_special_tokens)
        seq = Sequence(request_id, prompt_ids, params, detok, self.config.device)
        if params.structured is not None:
            seq.matcher = self.grammars().matcher(params.structured)
        self._requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Drop a request (waiting or running) and free its KV-cache slot; False if it is not here."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq)
        seq.finish_reason = "abort"
        if not self.scheduler.has_unfinished():
            self.runner.settle()
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """Run one batch; return an output for each request that got a token (finished or not)."""
        batch = self.scheduler.schedule()
        self.runner.copy_blocks(self.scheduler.pool.copies)  # the host tier's, before the step reads the blocks
        self.scheduler.pool.copies.clear()
        tokens, logprobs = self.runner.run(batch, lookahead=not self.scheduler.admits())
        outputs = self._postprocess(batch, tokens, logprobs)
        if not self.scheduler.has_unfinished():
            self.runner.settle()  # no step follows: a step launched ahead (a sequence stopped) is dropped
        return outputs

    def _postprocess(self, batch: list[ScheduledSeq], tokens: list[int | None],
                     logprobs: list[TokenLogprobs | None]) -> list[RequestOutput]:
        outputs = []
        for s, token, lp in zip(batch, tokens, logprobs):
            seq = s.seq
            seq.num_computed += s.num_tokens
            self.scheduler.cache_computed(seq)
            if token is None and seq.error is None:
                continue
            delta = ""
            if seq.error is None:
                if lp is not None:
                    seq.logprobs.append(lp)
                delta = self._append(seq, token)
            if seq.error is not None:
                seq.finish_reason = "error"
            outputs.append(seq.output(delta))
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
                del self._requests[seq.request_id]
        return outputs

    def _append(self, seq: Sequence, token: int) -> str:
        """seq.append_token; a failure there (its detokenizer, say) ends this sequence alone, with seq.error."""
        try:
            return seq.append_token(token, self.eos_token_ids)
        except Exception as e:  # noqa: BLE001 (any failure of one request's text must not end the others)
            seq.error = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"[:500]
            return ""

    def _check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise HybridMoEError("the prompt is empty; give at least one token")
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in prompt_ids):
            bad = next(t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size))
            raise HybridMoEError(f"prompt token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        if params.top_k > self.vocab_size:
            raise HybridMoEError(f"top_k must be at most the vocabulary's {self.vocab_size} tokens (0 disables), "
                                 f"got {params.top_k}")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise HybridMoEError(
                f"prompt of {len(prompt_ids)} tokens + max_tokens {params.max_tokens} = {total} exceeds the "
                f"context of {self.max_model_len} tokens (max_model_len); shorten the prompt or lower max_tokens")
        if params.stop and self.tokenizer is None:
            raise HybridMoEError("stop strings need a tokenizer, and this model directory has none; "
                                 "use stop_token_ids")


def _eos_token_ids(model_dir: Path, config, tokenizer: Tokenizer | None) -> frozenset[int]:
    """EOS ids from config.json, generation_config.json and the tokenizer's eos_token together."""
    ids: set[int] = set()
    sources = [config.get("eos_token_id")]
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        try:
            sources.append(json.loads(gen.read_text()).get("eos_token_id"))
        except ValueError:
            raise HybridMoEError(f"{gen} is not valid JSON; fix or delete it") from None
    if tokenizer is not None:
        sources.append(tokenizer.eos_token_id)
    for src in sources:
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, list):
            ids.update(t for t in src if isinstance(t, int))
    return frozenset(ids)
