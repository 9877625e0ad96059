"""Sequence-classification, token-classification and extractive question-answering heads for both models: what
`AutoModelForSequenceClassification`, `AutoModelForTokenClassification`, `AutoModelForQuestionAnswering`,
their pipelines and `Trainer` load.

Built like transformers' heads for decoder models (Llama's): a linear layer (`score`; `qa_outputs` for the start
and end of an answer span) on the base model's last hidden states, the loss chosen by `config.problem_type`
(regression, single- or multi-label classification) through transformers' own loss functions, `config.num_labels`
outputs. What differs:

- The sequence's summary (`config.classifier_pooling`): `"last"`, its last real token (in a causal model the only
  one that has seen every other token, through the Compressive memory too), or `"mean"`, the mean of its real
  tokens (the default of a non-causal Sinkhorn model, where sparse attention gives no single token all the others).
  Real tokens are those of the attention mask when one is given (left or right padding, `inputs_embeds` too),
  else those that are not `pad_token_id`, as in transformers' heads.
- The Compressive model adds its reconstruction loss (`reconstruction_loss_weight` x it) to the classification
  loss, so a classification run trains its compression network as language modelling does.
- `cache` (with `use_cache`) continues a document over several calls: classify a book chunk by chunk through the
  Compressive memory or a causal Sinkhorn cache; the logits of the last call summarise it with `"last"` pooling
  (`"mean"` averages the call's own tokens).
"""

from __future__ import annotations

import torch
from torch import nn

from .outputs import ClassifierOutput, QuestionAnsweringOutput


def pooling_of(config) -> str:
    """The config's `classifier_pooling`, None resolved: "last" for a causal model, "mean" otherwise."""
    if config.classifier_pooling is not None:
        return config.classifier_pooling
    return "last" if getattr(config, "causal", True) else "mean"


def dropout_of(config) -> float:
    """The config's `classifier_dropout`, None resolved as transformers' heads do: `hidden_dropout`, else 0.1."""
    if config.classifier_dropout is not None:
        return config.classifier_dropout
    hidden = getattr(config, "hidden_dropout", None)
    return hidden if hidden is not None else 0.1


def real_tokens(input_ids, attention_mask, pad_token_id, shape: torch.Size, device) -> torch.Tensor:
    """[batch, seq] bool: the tokens a head summarises (see the module docstring)."""
    if attention_mask is not None:
        return attention_mask[:, -shape[1] :].to(device=device, dtype=torch.bool)
    if input_ids is not None and pad_token_id is not None:
        return (input_ids != pad_token_id).to(device)
    return torch.ones(shape, dtype=torch.bool, device=device)


def pool(hidden: torch.Tensor, real: torch.Tensor, pooling: str) -> torch.Tensor:
    """hidden [batch, seq, width], real [batch, seq] -> [batch, width]: the last real token's state, or the mean of
    the real tokens' states. A row without real tokens gives its last token (or zeros, for the mean)."""
    if pooling == "mean":
        weights = real.to(hidden.dtype).unsqueeze(-1)
        return (hidden * weights).sum(1) / weights.sum(1).clamp(min=1)
    positions = torch.arange(real.shape[1], device=real.device)
    last = torch.where(real, positions, -1).amax(-1)  # rightmost real token; left or right padding
    last = torch.where(last < 0, real.shape[1] - 1, last)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]


class _ClassificationHead:
    """What the three heads share (listed before the model's PreTrainedModel class; `base_model_class`: its body)."""

    base_model_class: type

    def __init__(self, config):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = self.base_model_class(config)
        width = getattr(config, "embedding_size", config.hidden_size)  # Sinkhorn: after factorised embeddings
        self._add_outputs(width, config)
        self.post_init()

    def _add_outputs(self, width: int, config) -> None:
        """The head's own layers on the base model's `width`-wide states."""
        raise NotImplementedError

    def _body(self, input_ids, attention_mask, inputs_embeds, cache, past_key_values, use_cache, kwargs):
        """The base model's outputs (return_dict), taking Trainer's token count out of the keyword arguments: a
        classification loss is a mean over its call, as in transformers' heads."""
        kwargs.pop("num_items_in_batch", None)
        return self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            cache=cache if cache is not None else past_key_values,
            use_cache=use_cache,
            return_dict=True,
            **kwargs,
        )

    def _output(self, output_class, outputs, loss, return_dict, **fields):
        """The head's `output_class`: its loss plus the Compressive model's weighted reconstruction loss (when it has
        one), the base model's cache, hidden states and attentions, and the head's own `fields`."""
        reconstruction = getattr(outputs, "reconstruction_loss", None)
        if loss is not None and reconstruction is not None:
            loss = loss + self.config.reconstruction_loss_weight * reconstruction
        result = output_class(
            loss=loss,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            reconstruction_loss=reconstruction,
            **fields,
        )
        return result if (return_dict if return_dict is not None else self.config.return_dict) else result.to_tuple()


class SequenceClassification(_ClassificationHead):
    """One label (or regression value) per sequence: `score` on the pooled last hidden states."""

    def _add_outputs(self, width: int, config) -> None:
        self.score = nn.Linear(width, config.num_labels, bias=False)  # no bias: as transformers' decoder heads

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.Tensor | None = None,
        cache=None,
        past_key_values=None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> ClassifierOutput | tuple:
        """labels [batch]: class ids (or floats: regression with num_labels=1, multi-label with [batch, num_labels])."""
        outputs = self._body(input_ids, attention_mask, inputs_embeds, cache, past_key_values, use_cache, kwargs)
        hidden = outputs.last_hidden_state
        real = real_tokens(input_ids, attention_mask, self.config.pad_token_id, hidden.shape[:2], hidden.device)
        logits = self.score(pool(hidden, real, pooling_of(self.config)))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, pooled_logits=logits, config=self.config)
        return self._output(ClassifierOutput, outputs, loss, return_dict, logits=logits)


class TokenClassification(_ClassificationHead):
    """One label per token: `score` on every last hidden state, after dropout (`config.classifier_dropout`)."""

    def _add_outputs(self, width: int, config) -> None:
        self.dropout = nn.Dropout(dropout_of(config))
        self.score = nn.Linear(width, config.num_labels)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        cache=None,
        past_key_values=None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> ClassifierOutput | tuple:
        """labels [batch, seq]: a class id per token, -100 where no loss is wanted (padding, sub-word pieces)."""
        outputs = self._body(input_ids, attention_mask, inputs_embeds, cache, past_key_values, use_cache, kwargs)
        logits = self.score(self.dropout(outputs.last_hidden_state))
        loss = self.loss_function(logits, labels, self.config) if labels is not None else None
        return self._output(ClassifierOutput, outputs, loss, return_dict, logits=logits)


class QuestionAnswering(_ClassificationHead):
    """Extractive question answering: `qa_outputs` scores every token as the start and as the end of the answer."""

    def _add_outputs(self, width: int, config) -> None:
        self.qa_outputs = nn.Linear(width, 2)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        start_positions: torch.LongTensor | None = None,
        end_positions: torch.LongTensor | None = None,
        cache=None,
        past_key_values=None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> QuestionAnsweringOutput | tuple:
        """start_positions / end_positions [batch]: the answer span's first and last token (positions outside the
        input are ignored by the loss, as in transformers)."""
        outputs = self._body(input_ids, attention_mask, inputs_embeds, cache, past_key_values, use_cache, kwargs)
        start_logits, end_logits = self.qa_outputs(outputs.last_hidden_state).unbind(-1)
        loss = None
        if start_positions is not None and end_positions is not None:
            loss = self.loss_function(start_logits, end_logits, start_positions, end_positions)
        fields = dict(start_logits=start_logits.contiguous(), end_logits=end_logits.contiguous())
        return self._output(QuestionAnsweringOutput, outputs, loss, return_dict, **fields)


__all__ = [
    "QuestionAnswering",
    "SequenceClassification",
    "TokenClassification",
    "dropout_of",
    "pool",
    "pooling_of",
    "real_tokens",
]
