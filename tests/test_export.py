"""torch.export with a dynamic sequence length: one exported program for every length up to the Dim's max, equal
to the eager model at lengths that are and are not bucket / segment multiples, as transformers' models give it; and
an exported decoding step with its cache (`longrange.export.ExportableDecoder`), Llama's through transformers' own
recipe beside it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.export import Dim
from transformers import LlamaConfig, LlamaForCausalLM

from longrange import (
    CompressiveConfig,
    CompressiveForCausalLM,
    SinkhornConfig,
    SinkhornForCausalLM,
    SinkhornForMaskedLM,
)
from longrange.export import ExportableDecoder

pytestmark = pytest.mark.skipif(
    not hasattr(torch.compiler, "is_exporting"), reason="a dynamic length exports from torch 2.7 on (is_exporting)"
)
VOCAB = 32
SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
MAX = 16
LENGTHS = (2, 5, 8, 13, MAX)  # buckets of 4 and segments of 8: 5 and 13 are neither's multiple
MODELS = {
    "compressive": lambda: CompressiveForCausalLM(
        CompressiveConfig(**SMALL, intermediate_size=64, segment_length=8, mem_len=8, c_mem_len=4, compression_rate=2)
    ),
    "sinkhorn causal": lambda: SinkhornForCausalLM(
        SinkhornConfig(**SMALL, bucket_size=4, max_position_embeddings=64, causal=True)
    ),
    "sinkhorn masked": lambda: SinkhornForMaskedLM(
        SinkhornConfig(**SMALL, bucket_size=4, max_position_embeddings=64, causal=False, n_local_attn_heads=1)
    ),
}


def export(model, ids, mask=None, seq=None):
    kwargs = dict(input_ids=ids) if mask is None else dict(input_ids=ids, attention_mask=mask)
    if not isinstance(model, SinkhornForMaskedLM):
        kwargs["use_cache"] = False
    seq = seq if seq is not None else Dim("seq", min=2, max=MAX)
    shapes = {name: ({1: seq} if name != "use_cache" else None) for name in kwargs}
    return torch.export.export(model, args=(), kwargs=kwargs, dynamic_shapes=shapes, strict=False)


@pytest.mark.parametrize("name", MODELS)
def test_one_exported_program_equals_eager_at_every_length(name):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    generator = torch.Generator().manual_seed(1)
    program = export(model, torch.randint(0, VOCAB, (2, 7), generator=generator)).module()
    for length in LENGTHS:
        ids = torch.randint(0, VOCAB, (2, length), generator=generator)
        with torch.no_grad():
            eager = model(input_ids=ids).logits
            exported = program(input_ids=ids, **({} if name == "sinkhorn masked" else {"use_cache": False})).logits
        assert exported.shape == eager.shape
        torch.testing.assert_close(exported, eager, atol=2e-6, rtol=0, msg=f"length {length}")


def test_exported_program_takes_a_padding_mask():
    torch.manual_seed(0)
    model = MODELS["sinkhorn causal"]().eval()
    ids = torch.randint(0, VOCAB, (2, 9))
    mask = torch.ones_like(ids)
    program = export(model, ids, mask).module()
    mask[0, :3] = 0  # left padding
    with torch.no_grad():
        eager = model(input_ids=ids, attention_mask=mask).logits
        exported = program(input_ids=ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(exported[0, 3:], eager[0, 3:], atol=2e-6, rtol=0)
    torch.testing.assert_close(exported[1], eager[1], atol=2e-6, rtol=0)


def test_a_dynamic_length_without_a_maximum_is_refused():
    model = MODELS["sinkhorn masked"]().eval()
    with pytest.raises(ValueError, match=r"give its Dim a max"):
        export(model, torch.randint(0, VOCAB, (2, 7)), seq=Dim("seq"))


def test_is_exporting_is_true_under_torch_export_only():
    """`layers.is_exporting` picks the export-only paths (the routing's k rounds that torch.onnx exports, a dynamic
    length padded to its bound): true under torch.export, false in eager and in every torch.compile, where the dynamo
    of torch 2.7-2.11 answers `torch.compiler.is_exporting()` with True (pytorch/pytorch#176347; CI's cuda-codegen
    environment runs this test on torch 2.11, through tests/test_cuda_codegen.py)."""
    from longrange.layers import is_exporting

    class Probe(torch.nn.Module):
        def forward(self, x):
            return x + 1 if is_exporting() else x

    x = torch.zeros(2)
    assert not is_exporting() and torch.equal(Probe()(x), x)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(Probe(), backend="eager", fullgraph=True)(x), x)
    torch._dynamo.reset()
    assert torch.equal(torch.export.export(Probe(), (x,), strict=False).module()(x), x + 1)


# -- an exported decoding step: the cache's state in the program's buffers, written in place by every call ----------

STEPS = 18  # after a prompt of 7: past bucket starts (buckets of 4) and segment completions (segments of 8)


CUDA = pytest.param(  # (benchmarks/device_run.sh's `export` phase runs these on the device)
    "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
)


def exported_steps(name: str, ids: torch.Tensor, mask: torch.Tensor, tmp_path):
    """One-token steps of an exported program (saved and loaded back) after the prompt `ids` -> (step, the prompt's
    last logits). Llama through transformers' own recipe (its StaticCache in the program; the prompt fed token by
    token, one row, no padding): the reference behaviour."""
    torch.manual_seed(0)
    device = ids.device
    if name == "llama":
        from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

        config = LlamaConfig(**SMALL, intermediate_size=64, max_position_embeddings=64)
        model = LlamaForCausalLM(config).to(device).eval()
        model.generation_config.cache_implementation = "static"
        recipe = TorchExportableModuleForDecoderOnlyLM(model, 1, ids.shape[1] + STEPS, device)
        program = recipe.export(input_ids=ids[:, :1], cache_position=torch.tensor([0], device=device), strict=False)
        positions = iter(range(ids.shape[1] + STEPS))
        decoder = None
    else:
        model = MODELS[name]().to(device).eval()
        decoder = ExportableDecoder(model, ids, attention_mask=mask, max_new_tokens=STEPS)
        program = decoder.export()
    torch.export.save(program, tmp_path / "step.pt2")
    loaded = torch.export.load(tmp_path / "step.pt2").module()
    if decoder is not None:
        return model, loaded, decoder.prompt_logits
    step = lambda token: loaded(input_ids=token, cache_position=torch.tensor([next(positions)], device=device))  # noqa: E731
    with torch.no_grad():
        prompt_logits = [step(ids[:, i : i + 1]) for i in range(ids.shape[1])][-1][:, -1]
    return model, step, prompt_logits


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("name", ["compressive", "sinkhorn causal", "llama"])
def test_an_exported_decoding_step_equals_uncached_forwards_step_after_step(name, device, tmp_path):
    generator = torch.Generator().manual_seed(3)
    rows = 1 if name == "llama" else 2
    ids = torch.randint(1, VOCAB, (rows, 7), generator=generator).to(device)
    mask = torch.ones_like(ids)
    mask[1:, :3] = 0  # the second row left-padded: the rows at different fills
    model, step, prompt_logits = exported_steps(name, ids, mask, tmp_path)
    atol = 2e-6 if device == "cpu" else 1e-4  # (a GPU's attention kernels round otherwise)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, use_cache=False).logits[:, -1]
        torch.testing.assert_close(prompt_logits, expected, atol=atol, rtol=0)
        for _ in range(STEPS):  # tokens drawn at random (not the model's own): any next token
            token = torch.randint(1, VOCAB, (rows, 1), generator=generator).to(device)
            ids, mask = torch.cat([ids, token], 1), torch.cat([mask, torch.ones_like(token)], 1)
            expected = model(ids, attention_mask=mask, use_cache=False).logits[:, -1:]
            torch.testing.assert_close(step(token), expected, atol=atol, rtol=0, msg=f"token {ids.shape[1]}")


def test_an_exported_sinkhorn_step_past_its_cache_fails_loudly_and_bad_arguments_are_refused():
    model = MODELS["sinkhorn causal"]().eval()
    ids = torch.randint(1, VOCAB, (1, 5))
    step = ExportableDecoder(model, ids, max_new_tokens=3).export().module()
    token = torch.ones(1, 1, dtype=torch.long)
    with torch.no_grad():
        for _ in range(3):
            step(token)
        with pytest.raises(IndexError):  # the 9th token has no slot in the 8 the cache holds
            step(token)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        ExportableDecoder(model, ids, max_new_tokens=0)
    with pytest.raises(TypeError, match="SinkhornForCausalLM or CompressiveForCausalLM"):
        ExportableDecoder(MODELS["sinkhorn masked"](), ids)


def test_a_saved_decoding_step_loads_and_runs_where_longrange_cannot_be_imported(tmp_path):
    model = MODELS["compressive"]().eval()
    decoder = ExportableDecoder(model, torch.randint(1, VOCAB, (1, 7)))
    torch.export.save(decoder.export(), tmp_path / "step.pt2")
    with torch.no_grad():
        expected = decoder(torch.ones(1, 1, dtype=torch.long))  # (the decoder's own state, one step on)
    script = (
        "import sys; sys.modules['longrange'] = None\n"  # any import of longrange fails
        "import torch\n"
        f"step = torch.export.load({str(tmp_path / 'step.pt2')!r}).module()\n"
        f"torch.save(step(torch.ones(1, 1, dtype=torch.long)), {str(tmp_path / 'logits.pt')!r})\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, atol=2e-6, rtol=0)


@pytest.mark.parametrize("name", ["compressive", "sinkhorn causal"])
def test_an_exported_decoding_step_keeps_the_cache_state_as_buffers_it_mutates(name):
    """What runtimes that lower an exported program (ExecuTorch, AOTInductor) read: the decomposed program's buffer
    mutations. (A non-strict trace took the cache's tensors for constants, mutated in place behind the signature.)"""
    decoder = ExportableDecoder(MODELS[name]().eval(), torch.randint(1, VOCAB, (1, 7)))
    signature = decoder.export().run_decompositions().graph_signature
    buffers = {name.replace(".", "_") for name in decoder.cache.state_tensors()}
    assert set(signature.buffers) <= buffers  # (those a step never reads are left out: rows_history, kept for crop)
    counter, keys = ("seen_counter", "layers_0_ring_keys") if name == "compressive" else ("seen", "layers_0_keys")
    assert {counter, keys} <= set(signature.buffers_to_mutate.values()) <= buffers


def test_an_exported_compressive_step_compresses_the_newest_group_only():
    """A step that finds the cache's group buffers stale compresses and projects every held group first (eager steps
    after a prompt leave them so), and a program traced from it would do that at every call (7x the step's time at
    hidden 512 x 6). The decoder makes them current before tracing: its program has 2 products a layer fewer (f_c
    and the key/value projection of all groups) than one traced from a stale cache."""

    def products(stale: bool) -> int:
        decoder = ExportableDecoder(MODELS["compressive"]().eval(), torch.randint(1, VOCAB, (2, 7)))
        if stale:
            decoder.cache._groups_ready = False
        graph = decoder.export().graph
        return sum(node.target == torch.ops.aten.linear.default for node in graph.nodes)

    layers = SMALL["num_hidden_layers"]
    assert products(stale=True) - products(stale=False) == 2 * layers
