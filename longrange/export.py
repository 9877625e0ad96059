"""An exported decoding step: `ExportableDecoder` holds a causal model and its cache after a prompt, the cache's
tensors registered as the module's buffers, so that `torch.export` gives one program whose every call is a one-token
decoding step.

An exported program keeps its buffers and the in-place writes a call makes to them. The decoding caches of both
models keep their whole state in preallocated tensors that a step updates in place on the compiled path (static
shapes, nothing read back to the host: the path `torch.compile` takes, and the one a program is traced on), so the
program carries the state from one call to the next, as transformers' `TorchExportableModuleWithStaticCache` does
for a `StaticCache`. The prompt itself runs here, eagerly: the caches' prefill is another computation (Sinkhorn's
routing of whole buckets, the Compressive model's segments) that a one-token program does not hold.

ONNX has no state that persists between calls: `torch.onnx` keeps a program's buffers as constants and drops its
writes to them, so the step's ONNX form (`ExportableDecoder.export_onnx`) takes the whole state as inputs and returns
it, updated, as outputs (`StatePassingStep`), as ONNX decoders pass their past keys and values.
"""

from __future__ import annotations

import torch
from torch import nn

from .cache_compressive import CompressiveMemoryCache
from .cache_compressive_static import compress_groups_ahead
from .cache_sinkhorn import SinkhornCache
from .modeling_compressive import CompressiveForCausalLM
from .modeling_sinkhorn import SinkhornForCausalLM


def decoding_cache(model: nn.Module, max_cache_len: int | None):
    """The cache of `model`'s decoding steps in the form they update in place (as `generate()` makes it)."""
    if isinstance(model, SinkhornForCausalLM):  # preallocated for max_cache_len tokens (default: every position)
        return SinkhornCache(model.config, max_cache_len=max_cache_len, static_steps=True)
    if isinstance(model, CompressiveForCausalLM):  # bounded: any number of steps
        cache = CompressiveMemoryCache(model.config.num_hidden_layers)
        cache.prefill_to_static = True  # the prompt's no-grad forward leaves the static form the steps write
        return cache
    raise TypeError(f"ExportableDecoder: model must be a SinkhornForCausalLM or CompressiveForCausalLM, got {model!r}")


class ExportableDecoder(nn.Module):
    """One-token decoding steps of `model` after the prompt `input_ids` [batch, n] (left-padded rows marked by
    `attention_mask`), exportable with `torch.export`: each call takes every row's next token [batch, 1] and returns
    its logits [batch, 1, vocab], the cache's state kept in this module's buffers. `prompt_logits` [batch, vocab]
    are the prompt's last logits. A Sinkhorn cache holds the prompt and `max_new_tokens` more tokens (default: up
    to `max_position_embeddings`); the Compressive cache is bounded, any number of steps. Put the model in eval
    mode first (dropout would be traced as it is)."""

    def __init__(
        self,
        model: nn.Module,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int | None = None,
    ):
        super().__init__()
        if not hasattr(torch.compiler, "is_exporting"):  # (the export-only paths of the models are told apart so)
            raise RuntimeError(f"ExportableDecoder needs torch >= 2.7, found {torch.__version__}")
        if max_new_tokens is not None and (not isinstance(max_new_tokens, int) or max_new_tokens < 1):
            raise ValueError(f"ExportableDecoder: max_new_tokens must be an int >= 1 or None, got {max_new_tokens!r}")
        self.model = model
        total = None if max_new_tokens is None else input_ids.shape[-1] + max_new_tokens
        self.cache = decoding_cache(model, total)
        with torch.no_grad():
            out = model(input_ids, attention_mask=attention_mask, cache=self.cache, use_cache=True)
        self.prompt_logits = out.logits[:, -1]
        cache = self.cache
        if isinstance(cache, CompressiveMemoryCache):  # (a traced step that compressed them would do so at every
            compress_groups_ahead(cache, model.model.layers)  # call: 7x the step's time at 512 x 6)
        for name, tensor in self.cache.state_tensors().items():
            self.register_buffer(name.replace(".", "_"), tensor, persistent=False)

    def forward(self, input_ids: torch.LongTensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, cache=self.cache, use_cache=True).logits

    def export(self) -> torch.export.ExportedProgram:
        """`torch.export.export` of one step, traced by dynamo (strict, as transformers' recipe exports), which
        takes the cache's tensors for this module's buffers: the program's steps update them in place (the buffer
        mutations of the decomposed program; a non-strict trace read them as constants). Its `module()` starts from
        this decoder's state and shares its tensors (a saved and loaded program has its own)."""
        with torch.no_grad():
            return torch.export.export(self, (self.first_token(),), strict=True)

    def first_token(self) -> torch.LongTensor:
        """[batch, 1]: the prompt's greedy next token (a step's example input)."""
        return self.prompt_logits.argmax(-1, keepdim=True)

    def state(self) -> dict[str, torch.Tensor]:
        """A copy of the cache's state by name, each under the name the ONNX step takes it (`past.` + its name)."""
        return {f"past.{name}": tensor.clone() for name, tensor in self.cache.state_tensors().items()}

    def export_onnx(self, path: str | None = None):
        """The step as an ONNX program (`torch.onnx.ONNXProgram`, saved to `path` if given) that passes the state
        through: inputs `input_ids` [batch, 1] and the state (`state()`'s names and shapes), outputs `logits`
        [batch, 1, vocab] and the state after the step (`present.` + each name, in the inputs' order). Start from
        `state()` (after the prompt) and feed each call's state outputs to the next call. Needs onnxscript."""
        state = self.cache.state_tensors()
        step = StatePassingStep(self, list(state.values()))
        with torch.no_grad():  # traced by dynamo first (see `export`), then translated
            program = torch.export.export(step, (self.first_token(), *state.values()), strict=True)
        onnx_program = torch.onnx.export(
            program,
            dynamo=True,
            verbose=False,
            input_names=["input_ids", *(f"past.{name}" for name in state)],
            output_names=["logits", *(f"present.{name}" for name in state)],
        )
        if path is not None:
            onnx_program.save(str(path))
        return onnx_program


class StatePassingStep(nn.Module):
    """`step` (a module whose calls update the tensors `state` in place) as a function of the state: it takes the
    step's inputs followed by a value for every state tensor, copies those in, runs the step and returns its output
    followed by the state after it. For runtimes that keep no state between calls (ONNX). With `input_names` the
    inputs are passed to `step` by those names (e.g. transformers' `TorchExportableModuleWithStaticCache`, which
    takes `input_ids` and `cache_position`), else in order."""

    def __init__(self, step: nn.Module, state: list[torch.Tensor], input_names: tuple[str, ...] | None = None):
        super().__init__()
        self.step, self.state, self.input_names = step, state, input_names

    def forward(self, *inputs_and_state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inputs, values = inputs_and_state[: -len(self.state)], inputs_and_state[-len(self.state) :]
        for tensor, value in zip(self.state, values):
            tensor.copy_(value)
        if self.input_names is None:
            output = self.step(*inputs)
        else:
            output = self.step(**dict(zip(self.input_names, inputs, strict=True)))
        return output, *(tensor.clone() for tensor in self.state)
