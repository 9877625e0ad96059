"""longrange evaluate --mem_len / --c_mem_len: evaluating a Compressive model with another memory than it was trained
with (Transformer-XL's protocol). The weights do not depend on the memory lengths; the memory the model keeps does."""

from __future__ import annotations

import pytest
import torch
from script_utils import load_command

from longrange import CompressiveConfig, CompressiveForCausalLM, SinkhornConfig, SinkhornForCausalLM
from longrange.tokenization import byte_tokenizer

torch.set_num_threads(1)  # tiny models on a shared 2-core machine: one thread (as tests/test_train.py)


def save_tiny(folder, kind: str = "compressive"):
    tok = byte_tokenizer()
    torch.manual_seed(0)
    common = dict(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
    if kind == "compressive":
        config = CompressiveConfig(intermediate_size=64, segment_length=8, mem_len=8, c_mem_len=4, compression_rate=2,
                                   **common)  # fmt: skip
        model = CompressiveForCausalLM(config)
    else:
        model = SinkhornForCausalLM(SinkhornConfig(bucket_size=8, max_position_embeddings=64, causal=True, **common))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model


def memory_lengths(model, ids: torch.Tensor) -> list[tuple[int, int]]:
    """(compressed memory, memory) slots per layer after a forward over `ids` with the cache."""
    with torch.no_grad():
        cache = model.eval()(ids, use_cache=True).cache
    return [layer.lengths()[:2] for layer in cache.layers]


def test_override_changes_the_memory_kept_and_default_leaves_it(tmp_path):
    evaluate = load_command("evaluate")
    trained = save_tiny(tmp_path)
    ids = torch.randint(0, 256, (1, 160))  # 20 segments of 8: both memories fill up
    default = evaluate.load_model(str(tmp_path))
    assert (default.config.mem_len, default.config.c_mem_len) == (8, 4)
    assert memory_lengths(default, ids) == memory_lengths(trained, ids) == [(4, 8), (4, 8)]
    longer = evaluate.load_model(str(tmp_path), mem_len=24, c_mem_len=10)
    assert (longer.config.mem_len, longer.config.c_mem_len) == (24, 10)
    assert memory_lengths(longer, ids) == [(10, 24), (10, 24)]
    only_memory = evaluate.load_model(str(tmp_path), mem_len=16)  # one override: the other length as saved
    assert memory_lengths(only_memory, ids) == [(4, 16), (4, 16)]
    # the same weights (no parameter or buffer depends on the memory lengths), only more context
    assert evaluate.parameter_shapes(default.config) == evaluate.parameter_shapes(longer.config)
    for (name, a), (_, b) in zip(default.state_dict().items(), longer.state_dict().items()):
        assert torch.equal(a, b), name
    with torch.no_grad():
        first = default(ids[:, :8]).logits  # the first segment has no memory either way
        torch.testing.assert_close(longer(ids[:, :8]).logits, first)
        assert not torch.allclose(longer(ids).logits[:, -8:], default(ids).logits[:, -8:])


def test_main_reports_the_memory_used_and_scores_with_it(tmp_path):
    evaluate = load_command("evaluate")
    save_tiny(tmp_path)
    text = tmp_path / "doc.txt"
    torch.manual_seed(1)
    text.write_bytes(bytes(torch.randint(32, 127, (200,)).tolist()))
    plain, plain_scores = evaluate.main([str(tmp_path), str(text)])
    assert (plain["mem_len"], plain["c_mem_len"]) == (8, 4)
    same, same_scores = evaluate.main([str(tmp_path), str(text), "--mem_len", "8", "--c_mem_len", "4"])
    torch.testing.assert_close(same_scores.nll, plain_scores.nll)
    longer, longer_scores = evaluate.main([str(tmp_path), str(text), "--mem_len", "32", "--c_mem_len", "16"])
    assert (longer["mem_len"], longer["c_mem_len"]) == (32, 16)
    # tokens within reach of the trained memory (segment + mem 8 + 4 x 2 compressed) see the same context
    torch.testing.assert_close(longer_scores.nll[:15], plain_scores.nll[:15])
    assert not torch.allclose(longer_scores.nll, plain_scores.nll)
    # the override equals a model built with that memory from the start
    model = CompressiveForCausalLM(CompressiveConfig.from_dict({**plain_model_config(tmp_path), "mem_len": 32,
                                                                "c_mem_len": 16}))  # fmt: skip
    model.load_state_dict(evaluate.load_model(str(tmp_path)).state_dict())
    direct = evaluate.nll_with_cache(model.eval(), torch.tensor(list(text.read_bytes())), 64)
    torch.testing.assert_close(longer_scores.nll, direct.nll)


def plain_model_config(folder) -> dict:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder).to_dict()


def test_overrides_the_model_cannot_take_are_refused(tmp_path):
    evaluate = load_command("evaluate")
    save_tiny(tmp_path / "compressive")
    text = tmp_path / "doc.txt"
    text.write_bytes(b"some text to score " * 8)
    with pytest.raises(ValueError, match="c_mem_len must be an integer >= 0"):  # the config's own validation
        evaluate.main([str(tmp_path / "compressive"), str(text), "--c_mem_len", "-1"])
    with pytest.raises(ValueError, match="mem_len .* must be >= compression_rate"):
        evaluate.main([str(tmp_path / "compressive"), str(text), "--mem_len", "1"])
    save_tiny(tmp_path / "sinkhorn", kind="sinkhorn")
    with pytest.raises(ValueError, match="models with a memory"):
        evaluate.main([str(tmp_path / "sinkhorn"), str(text), "--mem_len", "16"])
    # a change that alters a weight's shape is refused (no memory length does; hidden_size stands in for one)
    config = evaluate.load_model(str(tmp_path / "compressive")).config
    wider = CompressiveConfig.from_dict({**config.to_dict(), "hidden_size": 64})
    with pytest.raises(ValueError, match="alters the model's weights .*embed_tokens.weight"):
        evaluate.check_same_parameters(config, wider)


def test_nll_with_cache_scores_rows_as_separate_documents(tmp_path):
    evaluate = load_command("evaluate")
    model = save_tiny(tmp_path).eval()
    rows = torch.randint(0, 256, (3, 50))
    together = evaluate.nll_with_cache(model, rows, 12).nll
    alone = torch.stack([evaluate.nll_with_cache(model, row, 16).nll for row in rows])
    assert together.shape == (3, 49)
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-5)
