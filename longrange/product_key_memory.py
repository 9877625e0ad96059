"""Product-key memory (Lample et al. 2019), shared by the Compressive and Sinkhorn models.

The query of each head is split in two halves; each half is scored against `num_keys` sub-keys, the top-k of
both halves are combined into the top-k of the `num_keys ** 2` product slots, and the selected value rows are
summed with softmax weights (an `EmbeddingBag`). Queries are normalised with a per-head LayerNorm rather than
BatchNorm: BatchNorm mixes statistics across the batch and the sequence, which leaks the future into the past
in a causal model and lets padding change real outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ProductKeyMemory(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_keys: int = 128,
        heads: int = 4,
        topk: int = 32,
        dim_key: int | None = None,
        input_dropout: float = 0.0,
        query_dropout: float = 0.0,
        value_dropout: float = 0.0,
        norm_halves: bool = False,
    ):
        super().__init__()
        if topk > num_keys:
            raise ValueError(f"product-key memory: topk ({topk}) must not exceed pkm_num_keys ({num_keys})")
        self.heads, self.num_keys, self.topk = heads, num_keys, topk
        self.dim_key = dim_key or hidden_size // 2
        self.to_queries = nn.Linear(hidden_size, heads * 2 * self.dim_key, bias=False)
        # applied to each head's query separately (norm_halves: to each half of it, as product_key_memory does)
        self.norm_halves = norm_halves
        self.query_norm = nn.LayerNorm(self.dim_key if norm_halves else 2 * self.dim_key)
        self.keys = nn.Parameter(torch.empty(heads, 2, num_keys, self.dim_key))
        self.values = nn.EmbeddingBag(num_keys**2, hidden_size, mode="sum")
        self.input_dropout = nn.Dropout(input_dropout)
        self.query_dropout = nn.Dropout(query_dropout)
        self.value_dropout = nn.Dropout(value_dropout)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.keys, std=self.dim_key**-0.5)
        nn.init.normal_(self.values.weight, std=self.values.weight.shape[1] ** -0.5)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = hidden_states.shape
        x = self.input_dropout(hidden_states)
        shape = (self.heads, 2, self.dim_key) if self.norm_halves else (self.heads, 2 * self.dim_key)
        queries = self.query_dropout(self.query_norm(self.to_queries(x).view(batch, seq, *shape)))
        queries = queries.view(batch, seq, self.heads, 2, self.dim_key)  # [b, n, h, half, d_key]
        scores = torch.einsum("bnhpd,hpkd->bnhpk", queries, self.keys.to(queries.dtype))  # [b, n, h, 2, K]
        top_scores, top_idx = scores.topk(self.topk, dim=-1)  # [b, n, h, 2, k]
        # all k*k combinations of the two halves' winners, then the best k of those
        combined = top_scores[..., 0, :, None] + top_scores[..., 1, None, :]  # [b, n, h, k, k]
        combined_idx = top_idx[..., 0, :, None] * self.num_keys + top_idx[..., 1, None, :]
        best_scores, best_pos = combined.flatten(-2).topk(self.topk, dim=-1)  # [b, n, h, k]
        best_idx = combined_idx.flatten(-2).gather(-1, best_pos)
        weights = F.softmax(best_scores.float(), dim=-1).to(hidden_states.dtype)
        # sum over heads and selected slots: one bag of heads * k rows per token
        out = self.values(
            best_idx.reshape(batch * seq, -1),
            per_sample_weights=weights.reshape(batch * seq, -1).to(self.values.weight.dtype),
        )
        return self.value_dropout(out.view(batch, seq, -1).to(hidden_states.dtype))


def pkm_parameter_groups(
    model: nn.Module, lr: float, pkm_value_lr: float = 1e-2, weight_decay: float = 0.0
) -> list[dict]:
    """Optimizer parameter groups that give the product-key memory values their own (higher) learning rate.

    >>> torch.optim.AdamW(pkm_parameter_groups(model, lr=3e-4, pkm_value_lr=1e-2))
    """
    value_params = {id(m.values.weight) for m in model.modules() if isinstance(m, ProductKeyMemory)}
    values, decay, no_decay = [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if id(param) in value_params:
            values.append(param)
        elif param.ndim < 2 or "norm" in name.lower():
            no_decay.append(param)
        else:
            decay.append(param)
    groups = [
        {"params": decay, "lr": lr, "weight_decay": weight_decay},
        {"params": no_decay, "lr": lr, "weight_decay": 0.0},
    ]
    if values:
        groups.append({"params": values, "lr": pkm_value_lr, "weight_decay": 0.0})
    return [g for g in groups if g["params"]]
