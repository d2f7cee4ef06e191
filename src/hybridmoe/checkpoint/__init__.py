"""Synthetic Hugging Face checkpoints of the MoE families we run: real tensor names and shapes,
random weights, a small tokenizer with the family's chat template. Used by `hybridmoe make-model`,
by tests, and by benchmarks at real shapes."""

from hybridmoe.checkpoint.make import RANDOM_WEIGHTS_KEY, CheckpointSummary, make_checkpoint
from hybridmoe.checkpoint.presets import ARCHS, PRESETS, model_config

__all__ = ["ARCHS", "PRESETS", "RANDOM_WEIGHTS_KEY", "CheckpointSummary", "make_checkpoint", "model_config"]
