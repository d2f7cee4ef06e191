"""DeepSeek's router: which K of E routed experts each token goes to, and with what weight.

T tokens, H hidden, E routed experts, K experts per token, G groups of E // G experts.

- softmax scoring (V2, V2-Lite, V2.5): "greedy" takes the top K scores; "group_limited_greedy"
  first keeps the topk_group groups with the highest max score and zeroes the rest.
- sigmoid scoring with "noaux_tc" (V3, R1, Kimi-K2): experts are *chosen* by sigmoid score +
  e_score_correction_bias (the aux-loss-free balancing bias) within the topk_group groups
  whose two best biased scores sum highest, but *weighted* by the unbiased sigmoid score.
Then weights are optionally renormalised to sum to 1 (norm_topk_prob) and multiplied by
routed_scaling_factor. Routing runs in float32 whatever the model's dtype, as in transformers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridmoe.errors import CheckpointError

TOPK_METHODS = {"softmax": ("greedy", "group_limited_greedy"), "sigmoid": ("noaux_tc",)}


class DeepseekRouter(nn.Module):
    def __init__(self, hidden_size: int, n_routed_experts: int, num_experts_per_tok: int, *,
                 scoring_func: str, topk_method: str, n_group: int | None = None,
                 topk_group: int | None = None, norm_topk_prob: bool = False,
                 routed_scaling_factor: float = 1.0):
        super().__init__()
        if topk_method not in TOPK_METHODS.get(scoring_func, ()):
            raise CheckpointError(
                f"unsupported DeepSeek routing scoring_func={scoring_func!r} topk_method={topk_method!r}; "
                f"supported: {', '.join(f'{s}/{m}' for s, ms in TOPK_METHODS.items() for m in ms)}")
        grouped = topk_method != "greedy"
        n_group, topk_group = (n_group or 1, topk_group or 1) if grouped else (1, 1)
        if n_routed_experts % n_group or not 1 <= topk_group <= n_group:
            raise CheckpointError(
                f"n_group={n_group} must divide n_routed_experts={n_routed_experts} and be >= topk_group={topk_group}")
        if num_experts_per_tok > topk_group * (n_routed_experts // n_group):
            raise CheckpointError(
                f"num_experts_per_tok={num_experts_per_tok} exceeds the experts in topk_group={topk_group} groups")
        self.top_k = num_experts_per_tok
        self.scoring_func, self.topk_method = scoring_func, topk_method
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(n_routed_experts, hidden_size, dtype=torch.float32))
        if topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(n_routed_experts, dtype=torch.float32))

    def _apply(self, fn, recurse=True):
        # Like transformers' _keep_in_fp32_modules: casting the model to bf16 must not round the
        # router, whose e_score_correction_bias checkpoints store in float32.
        super()._apply(fn, recurse)
        for p in self.parameters(recurse=False):
            p.data = p.data.float()
        return self

    def _group_mask(self, scores: torch.Tensor, group_score) -> torch.Tensor:
        """[T, E] bool: experts in each token's topk_group best groups."""
        grouped = scores.view(scores.shape[0], self.n_group, -1)  # [T, G, E/G]
        best = torch.topk(group_score(grouped), k=self.topk_group, dim=-1, sorted=False).indices
        mask = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=scores.device)
        mask.scatter_(1, best, True)
        return mask.unsqueeze(-1).expand_as(grouped).reshape_as(scores)

    def forward(self, hidden: torch.Tensor, logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> topk_ids [T, K] long, topk_weights [T, K] float32. logits: hidden's [T, E]
        float32 logits if the caller made them (DecoderLayer's norm + router GEMV)."""
        if logits is None:
            logits = F.linear(hidden.float(), self.weight.float())  # [T, E]
        if self.scoring_func == "softmax":
            scores = logits.softmax(dim=-1)
            if self.topk_method == "group_limited_greedy":
                keep = self._group_mask(scores, lambda g: g.max(dim=-1).values)
                scores = scores.masked_fill(~keep, 0.0)
            weights, ids = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        else:
            scores = logits.sigmoid()
            biased = scores + self.e_score_correction_bias.float()
            keep = self._group_mask(biased, lambda g: g.topk(min(2, g.shape[-1]), dim=-1).values.sum(dim=-1))
            ids = torch.topk(biased.masked_fill(~keep, float("-inf")), k=self.top_k, dim=-1, sorted=False).indices
            weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.routed_scaling_factor
