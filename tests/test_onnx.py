"""ONNX: the models export with `torch.onnx.export(..., dynamo=True)`, with a dynamic length, and run in
onnxruntime as in eager, as transformers' Llama does.

The exporter has no stable sort (`aten.sort.stable`), which the models used twice: to move each row's real tokens
first (`real_tokens_first`) and to pick the best buckets with ties to the lowest index (`top_indices`, which
takes `_top_rounds` while exporting). Both are written with exportable operators; the first tests hold them to
torch's stable sort, the reference they replace. The attention outputs' head merge copies explicitly while exporting
(`merge_heads`): the exporter's attention returns other strides than the traced op (pytorch/pytorch#136543).

A decoding step with its cache (`ExportableDecoder.export_onnx`) passes the cache's state in and out, as Llama's
static-cache step does through the same `StatePassingStep`; onnxruntime has no Where over bool tensors, which the
caches' in-place masks would use (`layers.where` writes those as logical operations while exporting).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from client_utils import require_client
from torch.export import Dim
from transformers import LlamaConfig, LlamaForCausalLM

from longrange import (
    CompressiveConfig,
    CompressiveForCausalLM,
    SinkhornConfig,
    SinkhornForCausalLM,
    SinkhornForMaskedLM,
    layers,
    sinkhorn_routing,
)
from longrange.export import ExportableDecoder, StatePassingStep
from longrange.layers import real_tokens_first
from longrange.sinkhorn_routing import _top_rounds, top_indices
from tests.dispatch_utils import count_dispatched_ops

VOCAB = 40


def stable_descending(scores: torch.Tensor) -> torch.Tensor:
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices


def test_top_indices_are_a_stable_descending_sorts_first_k_also_in_exportable_rounds():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randint(-3, 4, (3, 4, 5, 9), generator=generator).float()  # many ties
    scores[0, 0, 0] = -1e30  # every candidate masked alike (the routing's NEG)
    scores[0, 0, 1, :5] = float("-inf")
    scores[0, 0, 2] = float("-inf")
    scores[1, 1, 1, ::2] = -0.0  # -0.0 and 0.0 tie
    for k in range(1, 10):
        assert torch.equal(_top_rounds(scores, k), stable_descending(scores)[..., :k]), k  # the export's form
        assert torch.equal(top_indices(scores, k), stable_descending(scores)[..., :k]), k
    distinct = torch.randn(2, 3, 17, generator=generator)
    assert torch.equal(_top_rounds(distinct, 4), distinct.topk(4, dim=-1).indices)
    assert torch.equal(top_indices(distinct, 4), distinct.topk(4, dim=-1).indices)


def test_top_indices_sorts_unless_an_export_may_be_tracing(monkeypatch):
    scores = torch.randn(2, 3, 9, generator=torch.Generator().manual_seed(2))

    def forms(exporting: bool, can_tell: bool) -> tuple[int, int]:
        monkeypatch.setattr(torch.compiler, "is_exporting", lambda: exporting, raising=False)  # (torch >= 2.7)
        monkeypatch.setattr(torch.compiler, "_is_exporting_flag", exporting, raising=False)  # what torch.export sets
        monkeypatch.setattr(sinkhorn_routing, "CAN_TELL_EXPORT", can_tell)
        counts = count_dispatched_ops(lambda: top_indices(scores, 2))
        return counts["aten.sort"], counts["aten.argmax"]

    assert forms(exporting=False, can_tell=True) == (1, 0)  # one stable sort
    assert forms(exporting=True, can_tell=True) == (0, 2)  # torch.export tracing: the exportable rounds
    assert forms(exporting=False, can_tell=False) == (0, 2)  # torch < 2.7 cannot tell: always the rounds


def test_real_tokens_first_is_a_stable_sort_of_the_padding_flags():
    generator = torch.Generator().manual_seed(1)
    valid = torch.rand(6, 13, generator=generator) < 0.6
    valid[0] = True
    valid[1] = False
    expected = torch.sort((~valid).to(torch.uint8), dim=1, stable=True).indices
    assert torch.equal(real_tokens_first(valid), expected)


def test_merge_heads_copies_only_while_exporting(monkeypatch):
    heads_last = torch.randn(2, 5, 3, 4)  # [batch, len, heads, d_head] in memory: the layout SDPA kernels return
    out = heads_last.transpose(1, 2)  # seen as [batch, heads, len, d_head]
    expected = torch.cat([out[:, h] for h in range(3)], dim=-1)  # the heads side by side, by hand
    for exporting, shares_memory in ((False, True), (True, False)):
        monkeypatch.setattr(layers, "is_exporting", lambda exporting=exporting: exporting)
        merged = layers.merge_heads(out)
        assert torch.equal(merged, expected)
        assert (merged.data_ptr() == heads_last.data_ptr()) is shares_memory  # eager: a view, no copy


def test_where_over_bool_tensors_is_logical_operations_while_exporting(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    condition, a, b = (torch.rand(3, 1, 5, generator=generator) > 0.5 for _ in range(3))
    b = b.expand(3, 4, 5)  # broadcast, as the caches' masks are
    for exporting in (False, True):
        monkeypatch.setattr(layers, "is_exporting", lambda exporting=exporting: exporting)
        c, x, y = (t.flatten().tolist() for t in torch.broadcast_tensors(condition, a, b))
        expected = torch.tensor([xi if ci else yi for ci, xi, yi in zip(c, x, y)]).view(3, 4, 5)  # by hand
        assert torch.equal(layers.where(condition, a, b), expected)
        floats = torch.randn(3, 4, 5, generator=generator)
        assert torch.equal(layers.where(condition, floats, -floats), torch.where(condition, floats, -floats))


class Logits(torch.nn.Module):
    """The exported function: token ids and their padding mask -> logits (a causal model without a cache)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        kwargs = {} if isinstance(self.model, SinkhornForMaskedLM) else {"use_cache": False}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits


def build(name: str) -> torch.nn.Module:
    if name == "llama":  # transformers' own model: the reference behaviour of the exporter and onnxruntime
        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
            max_position_embeddings=64,
        )  # fmt: skip
        return LlamaForCausalLM(config)
    if name == "compressive":  # 32 tokens in segments of 8: memories fill, older ones are compressed
        config = CompressiveConfig(
            vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, segment_length=8,
            mem_len=8, c_mem_len=4, cmem_ratio=2,
        )  # fmt: skip
        return CompressiveForCausalLM(config)
    masked = name == "sinkhorn-masked"
    config = SinkhornConfig(
        vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, bucket_size=8,
        causal=not masked, max_position_embeddings=64, n_local_attn_heads=1, emb_dim=16,
    )  # fmt: skip
    return (SinkhornForMaskedLM if masked else SinkhornForCausalLM)(config)


# each export takes 4-10 s on 2 cores, the causal Sinkhorn's 20 s: a slow test (CI runs it, in the environment that
# installs onnxruntime)
@pytest.mark.parametrize(
    "name", ["sinkhorn-masked", pytest.param("sinkhorn-causal", marks=pytest.mark.slow), "compressive", "llama"]
)
def test_exports_to_onnx_with_a_dynamic_length_and_runs_in_onnxruntime_as_in_eager(name, tmp_path):
    require_client("onnxscript")  # torch.onnx's dynamo exporter translates through it
    onnxruntime = require_client("onnxruntime")
    torch.manual_seed(0)
    model = Logits(build(name)).eval()
    ids = torch.randint(0, VOCAB, (2, 32))
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[1, :5] = 0  # left padding (Sinkhorn moves the real tokens first: real_tokens_first)
    seq = Dim("seq", min=2, max=32)
    program = torch.onnx.export(
        model,
        (ids, mask),
        dynamo=True,
        verbose=False,
        dynamic_shapes={"input_ids": {1: seq}, "attention_mask": {1: seq}},
    )
    program.save(str(tmp_path / "model.onnx"))

    session = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    for length in (32, 13, 5):  # new inputs at the exported length and shorter ones
        ids = torch.randint(0, VOCAB, (2, length))
        mask = torch.ones(2, length, dtype=torch.long)
        mask[1, :2] = 0
        (logits,) = session.run(None, {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})
        assert logits.shape == (2, length, VOCAB)
        with torch.no_grad():
            expected = model(ids, mask)
        real = mask.bool()  # (Llama's outputs at padding positions differ between the two; nobody reads them)
        torch.testing.assert_close(torch.from_numpy(logits)[real], expected[real], rtol=1e-5, atol=1e-5)


# -- a decoding step with its cache: the state passed in and returned ------------------------------------------------

PROMPT, STEPS = 7, 18  # segments and buckets of 8: the steps complete segments, compress memories, start buckets


def onnx_step(name: str, model, ids, mask, path):
    """(session, the step's inputs besides the token and state, the state after the prompt, the prompt's last
    logits): our models through ExportableDecoder.export_onnx; Llama's static-cache step (transformers' own recipe)
    through the same StatePassingStep, its prompt fed token by token from an empty cache (one row, no padding)."""
    onnxruntime = require_client("onnxruntime")
    if name != "llama":
        decoder = ExportableDecoder(model, ids, attention_mask=mask, max_new_tokens=STEPS)
        before = {key: value.clone() for key, value in decoder.cache.state_tensors().items()}
        decoder.export_onnx(path)
        for key, value in decoder.cache.state_tensors().items():  # exporting ran no step for real
            assert torch.equal(value, before[key]), key
        # torch.onnx writes `as_strided` as a Gather of every element of the view: over a cache tensor, the cost of
        # the whole cache every step (Sinkhorn's bucket picks were one: 11x slower, benchmarks/benchmark_export.py)
        nodes = [node.name for node in require_client("onnx").load(str(path)).graph.node]
        assert nodes and not [node for node in nodes if "as_strided" in node]
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        state = {key: value.numpy() for key, value in decoder.state().items()}
        return session, lambda: {}, state, decoder.prompt_logits
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model.generation_config.cache_implementation = "static"
    recipe = TorchExportableModuleForDecoderOnlyLM(model, 1, PROMPT + STEPS, "cpu")
    state = [tensor for layer in recipe.model.static_cache.layers for tensor in (layer.keys, layer.values)]
    step = StatePassingStep(recipe.model, state, input_names=("input_ids", "cache_position"))  # (by keyword)
    names = [f"past.{i}" for i in range(len(state))]
    with torch.no_grad():
        program = torch.export.export(step, (ids[:, :1], torch.tensor([0]), *state), strict=True)
    torch.onnx.export(
        program, dynamo=True, verbose=False, input_names=["input_ids", "cache_position", *names],
        output_names=["logits", *(f"present.{i}" for i in range(len(state)))],
    ).save(str(path))  # fmt: skip
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    positions = iter(range(PROMPT + STEPS))
    extra = lambda: {"cache_position": np.array([next(positions)])}  # noqa: E731
    values = {name: np.zeros(tensor.shape, np.float32) for name, tensor in zip(names, state)}
    for i in range(PROMPT):
        logits, *new = session.run(None, {"input_ids": ids[:, i : i + 1].numpy(), **extra(), **values})
        values = dict(zip(values, new))
    return session, extra, values, torch.from_numpy(logits[:, -1])


# each export takes 5-25 s on 2 cores (the causal Sinkhorn step the longest): the Sinkhorn case is a slow test
@pytest.mark.parametrize("name", ["compressive", pytest.param("sinkhorn-causal", marks=pytest.mark.slow), "llama"])
def test_a_decoding_step_exports_to_onnx_with_its_state_and_runs_in_onnxruntime_as_uncached_forwards(name, tmp_path):
    require_client("onnxscript")
    torch.manual_seed(0)
    model = build(name).eval()
    generator = torch.Generator().manual_seed(1)
    rows = 1 if name == "llama" else 2
    ids = torch.randint(1, VOCAB, (rows, PROMPT), generator=generator)
    mask = torch.ones_like(ids)
    mask[1:, :3] = 0  # our second row left-padded: the rows at different fills
    session, extra, state, prompt_logits = onnx_step(name, model, ids, mask, tmp_path / "step.onnx")
    assert [o.name for o in session.get_outputs()] == ["logits", *(n.replace("past.", "present.") for n in state)]
    with torch.no_grad():
        torch.testing.assert_close(prompt_logits, model(ids, attention_mask=mask).logits[:, -1], atol=2e-6, rtol=0)
        for _ in range(STEPS):  # tokens drawn at random (not the model's own): any next token
            token = torch.randint(1, VOCAB, (rows, 1), generator=generator)
            logits, *new = session.run(None, {"input_ids": token.numpy(), **extra(), **state})
            state = dict(zip(state, new))
            ids, mask = torch.cat([ids, token], 1), torch.cat([mask, torch.ones_like(token)], 1)
            expected = model(ids, attention_mask=mask, use_cache=False).logits[:, -1:]
            torch.testing.assert_close(torch.from_numpy(logits), expected, atol=2e-6, rtol=0, msg=f"{ids.shape[1]}")
