"""ONNX: the Sinkhorn models export with `torch.onnx.export(..., dynamo=True)` and run in onnxruntime as in eager.

The exporter has no stable sort (`aten.sort.stable`), which the models used twice: to move each row's real tokens
first (`real_tokens_first`) and to pick the best buckets with ties to the lowest index (`top_indices`, which
takes `_top_rounds` while exporting). Both are written with exportable operators; the first tests hold them to
torch's stable sort, the reference they replace.
"""

from __future__ import annotations

import pytest
import torch
from client_utils import require_client

from longrange import SinkhornConfig, SinkhornForCausalLM, SinkhornForMaskedLM, sinkhorn_routing
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


class Logits(torch.nn.Module):
    """The exported function: token ids and their padding mask -> logits (the causal model without a cache)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        kwargs = {"use_cache": False} if isinstance(self.model, SinkhornForCausalLM) else {}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits


# the causal export takes 20 s on 2 cores: a slow test (CI runs it, in the environment that installs onnxruntime)
@pytest.mark.parametrize("masked", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["masked", "causal"])
def test_sinkhorn_exports_to_onnx_and_runs_in_onnxruntime_as_in_eager(masked, tmp_path):
    require_client("onnxscript")  # torch.onnx's dynamo exporter translates through it
    onnxruntime = require_client("onnxruntime")
    torch.manual_seed(0)
    config = SinkhornConfig(
        vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, bucket_size=8,
        causal=not masked, max_position_embeddings=64, n_local_attn_heads=1, emb_dim=16,
    )  # fmt: skip
    model = Logits((SinkhornForMaskedLM if masked else SinkhornForCausalLM)(config)).eval()
    ids = torch.randint(0, VOCAB, (2, 32))
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[1, :5] = 0  # left padding: the real tokens move first (real_tokens_first)
    program = torch.onnx.export(model, (ids, mask), dynamo=True, verbose=False)
    program.save(str(tmp_path / "model.onnx"))

    session = onnxruntime.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    other_ids = torch.randint(0, VOCAB, (2, 32))  # new inputs of the exported shape
    for inputs in ((ids, mask), (other_ids, mask)):
        (logits,) = session.run(None, {"input_ids": inputs[0].numpy(), "attention_mask": inputs[1].numpy()})
        with torch.no_grad():
            expected = model(*inputs)
        torch.testing.assert_close(torch.from_numpy(logits), expected, rtol=1e-5, atol=1e-5)
