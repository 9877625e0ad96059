"""Model card, upload, and the local `evaluate` metrics (which must load with no network)."""

from __future__ import annotations

import json
import math

import evaluate
import numpy as np
import pytest
import torch
from huggingface_hub import ModelCard

from longrange import CompressiveConfig, CompressiveForCausalLM
from longrange.hub import check_model_source, example_prompt, prepare_hub_folder, push_folder, write_model_card
from longrange.metrics import load_metric, metric_path
from longrange.tokenization import byte_tokenizer


def test_local_accuracy_metric_loads_offline_and_counts(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rng = np.random.default_rng(0)
    predictions, references = rng.integers(0, 5, 200), rng.integers(0, 5, 200)
    accuracy = evaluate.load(metric_path("accuracy"))  # the plain evaluate API on the folder
    expected = sum(int(p == r) for p, r in zip(predictions, references)) / 200
    assert accuracy.compute(predictions=predictions, references=references)["accuracy"] == pytest.approx(expected)
    weights = rng.random(200)
    weighted = sum(w for p, r, w in zip(predictions, references, weights) if p == r) / weights.sum()
    result = accuracy.compute(predictions=predictions, references=references, sample_weight=weights)
    assert result["accuracy"] == pytest.approx(weighted)


def test_local_perplexity_metric():
    perplexity = load_metric("perplexity")
    nll = [math.log(2.0), math.log(8.0)]  # geometric mean of 2 and 8 is 4
    result = perplexity.compute(predictions=nll, num_bytes=4)
    assert result["perplexity"] == pytest.approx(4.0)
    assert result["bits_per_token"] == pytest.approx(2.0)
    assert result["bits_per_byte"] == pytest.approx((1 + 3) / 4)
    with pytest.raises(ValueError, match="unknown local metric"):
        metric_path("bleu")


@pytest.fixture
def saved_compressive(tmp_path):
    tok = byte_tokenizer()
    torch.manual_seed(0)
    config = CompressiveConfig(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        segment_length=8, mem_len=8, c_mem_len=4, compression_rate=2,
    )  # fmt: skip
    model = CompressiveForCausalLM(config)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder, model, tok


def test_model_card_has_data_config_metrics_and_usage(saved_compressive):
    folder, model, tok = saved_compressive
    card = write_model_card(
        folder,
        model=model,
        tokenizer=tok,
        dataset="tinyshakespeare.txt, first 90% by position",
        metrics={"validation bits per character": 1.5432109},
        training_args={"max_steps": 100, "learning_rate": 3e-4},
        repo_id="me/tiny-compressive",
        prompt=example_prompt(b"\n\nFirst Citizen:\nBefore we proceed any further, hear me speak.\n"),
    ).read_text()
    assert card.startswith("---\nlibrary_name: transformers\n")
    assert "tinyshakespeare.txt, first 90% by position" in card
    assert "| `segment_length` | 8 |" in card and "| `mem_len` | 8 |" in card
    assert f"| parameters | {sum(p.numel() for p in model.parameters()):,} |" in card
    assert "| validation bits per character | 1.543 |" in card
    assert "| `learning_rate` | 0.0003 |" in card
    assert 'AutoModelForCausalLM.from_pretrained("me/tiny-compressive", trust_remote_code=True)' in card
    assert "Rae et al., 2019, *Compressive Transformers for Long-Range Sequence Modelling*" in card
    # the usage example prompts with the start of the training text (its first non-blank line); install
    # instructions name no package index the package is not on
    assert "inputs = tokenizer('First Citizen:', return_tensors=\"pt\")" in card
    assert "pypi.org" not in card and "pip install longrange" not in card and "pip install ." in card
    # the metadata block, as the Hub reads it
    metadata = ModelCard.load(folder / "README.md").data.to_dict()
    assert metadata == {
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["longrange", "compressive", "custom_code"],
    }
    # without a live model, the card reads config.json in the folder
    assert "| `segment_length` | 8 |" in write_model_card(folder).read_text()


def test_example_prompt_is_the_first_line_of_the_text_cut_short():
    assert example_prompt("\n  \nimport os\nimport sys\n") == "import os"
    assert example_prompt(b'"""A docstring that runs on and on past the cut."""\n', length=20) == '"""A docstring that'
    assert example_prompt("abcdefghijkl", length=5) == "abcde"  # no space to cut at
    assert example_prompt(b"\xff\xfeabc") == "abc"  # bytes that are not UTF-8 are left out


def test_prepare_keeps_existing_card_pointed_at_repo(saved_compressive, tmp_path):
    folder, model, tok = saved_compressive
    write_model_card(folder, model=model, metrics={"loss": 1.0})  # usage snippet names the local folder
    out = prepare_hub_folder(folder, tmp_path / "upload", repo_id="me/x")
    card = (out / "README.md").read_text()
    assert "| loss | 1 |" in card and 'from_pretrained("me/x", trust_remote_code=True)' in card
    assert str(folder) not in card
    with pytest.raises(FileExistsError, match="not empty"):
        prepare_hub_folder(folder, out)
    with pytest.raises(FileNotFoundError, match="config.json"):
        prepare_hub_folder(tmp_path, tmp_path / "other")


def test_push_folder_creates_repo_and_uploads_that_folder(saved_compressive, tmp_path, monkeypatch):
    import huggingface_hub

    folder, _, _ = saved_compressive
    out = prepare_hub_folder(folder, tmp_path / "upload", repo_id="me/x")
    calls = []
    monkeypatch.setattr(huggingface_hub, "create_repo", lambda repo_id, **kw: calls.append(("create", repo_id, kw)))

    def fake_upload(**kw):
        calls.append(("upload", kw["repo_id"], kw))
        return "https://huggingface.co/me/x/commit/0"

    monkeypatch.setattr(huggingface_hub, "upload_folder", fake_upload)
    assert push_folder(out, "me/x", private=True).endswith("/commit/0")
    assert [c[:2] for c in calls] == [("create", "me/x"), ("upload", "me/x")]
    assert calls[0][2]["private"] is True and calls[1][2]["folder_path"] == str(out)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        push_folder(tmp_path, "me/x")
    assert json.loads((out / "config.json").read_text())["model_type"] == "compressive"


def test_check_model_source_says_what_is_wrong(saved_compressive, tmp_path):
    folder, _, _ = saved_compressive
    assert check_model_source(folder) == str(folder)
    assert check_model_source("me/tiny-compressive") == "me/tiny-compressive"  # a Hub id is passed on
    with pytest.raises(FileNotFoundError, match="no such model folder"):
        check_model_source("./runs/missing")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        check_model_source(tmp_path)
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        check_model_source(folder)
