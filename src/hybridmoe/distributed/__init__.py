"""Tensor parallelism: the attention, Gated DeltaNet and dense layers split across N processes by heads, one CPU
expert engine.

EngineConfig.tensor_parallel_size N (--tensor-parallel-size N, LLM(..., tensor_parallel_size=N)) makes the calling
process rank 0 of a group of N over torch.distributed: gloo on the CPU, NCCL on CUDA with one GPU per rank (the
NCCL path is written to the same plan; CI runs the gloo one).

- parallel_state.py: a rank's place in the group (rank, world size, device) and its collectives.
- sharded_linear.py: column-parallel, row-parallel (all-reduced) and vocabulary-parallel (all-gathered) linears.
- sharded_norm.py: an RMSNorm over all heads together (MiniMax-M2's q/k norms) on this rank's heads' slice, its
  mean of squares all-reduced.
- shard.py: a model built on the meta device split in place before its weights load (which layers split how).
- checkpoint_slices.py: the checkpoint as one rank reads it (each split tensor's slice for that rank).
- experts.py: the routed experts on rank 0 only, their output broadcast to the other ranks.
- messages.py, lockstep.py, worker.py: rank 0's engine schedules and samples; each model call it makes is sent to
  the workers, which make it on their shards (the model forward only).
- launcher.py: rank 0 starts, watches and stops the workers; checks.py: what runs and what is refused.

The engine's hooks: engine/model_loader.py shards a rank's model before its weights load; engine/llm_engine.py
starts the workers and drives rank 0's model through LockstepModel.
"""
