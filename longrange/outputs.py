"""What the models return, beside transformers' own outputs: the Compressive model's (which add its reconstruction
loss) and the classification heads' of both models (longrange/classification.py). The Sinkhorn model's own outputs
live in modeling_sinkhorn.py, beside the routing record they carry.

Every class with a cache takes the installed transformers' name for it (`cache_output`, longrange/compat.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache
from transformers.utils import ModelOutput

from .compat import cache_output


@cache_output
@dataclass
class CompressiveModelOutput(ModelOutput):
    """last_hidden_state [batch, seq, hidden]; cache (when use_cache); hidden_states (embeddings + each layer's
    output, when asked); attentions (with output_attentions: per layer [batch, heads, seq, c_mem_len + mem_len +
    segment_length], each token's attention over the compressed-memory slots, the memory slots (both newest last)
    and the positions of its segment; slots not held are zero); reconstruction_loss (training with a
    reconstruction loss, once compression happened)."""

    last_hidden_state: torch.FloatTensor | None = None
    cache: Cache | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None
    reconstruction_loss: torch.FloatTensor | None = None


@cache_output
@dataclass
class CompressiveCausalLMOutput(ModelOutput):
    """loss = lm_loss + reconstruction_loss_weight * reconstruction_loss (what Trainer optimises); lm_loss and
    reconstruction_loss separately for logging; logits [batch, seq, vocab]; cache; hidden_states; attentions (see
    CompressiveModelOutput)."""

    loss: torch.FloatTensor | None = None
    lm_loss: torch.FloatTensor | None = None
    reconstruction_loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    cache: Cache | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None


@cache_output
@dataclass
class ClassifierOutput(ModelOutput):
    """A classification head's output: loss (with labels: the classification loss, plus reconstruction_loss_weight x
    reconstruction_loss for the Compressive model); logits ([batch, num_labels] for a sequence head, [batch, seq,
    num_labels] for a token head); cache (when use_cache: continue the document in the next call); hidden_states;
    attentions (as the base model's); reconstruction_loss (the Compressive model, training, once memories were
    compressed)."""

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    cache: Cache | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None
    reconstruction_loss: torch.FloatTensor | None = None


@cache_output
@dataclass
class QuestionAnsweringOutput(ModelOutput):
    """A question-answering head's output: loss (with start and end positions: transformers' span loss, plus the
    Compressive model's weighted reconstruction loss); start_logits, end_logits [batch, seq]; cache;
    hidden_states; attentions; reconstruction_loss (as ClassifierOutput)."""

    loss: torch.FloatTensor | None = None
    start_logits: torch.FloatTensor | None = None
    end_logits: torch.FloatTensor | None = None
    cache: Cache | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None
    reconstruction_loss: torch.FloatTensor | None = None


__all__ = [
    "ClassifierOutput",
    "CompressiveCausalLMOutput",
    "CompressiveModelOutput",
    "QuestionAnsweringOutput",
]
