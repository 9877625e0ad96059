"""benchmarks/check_long_runs.py (RSS along a long generation and two training runs) in its quick mode, and what the
full runs found bounded: the Trainer's running loss parts keep no per-step tensors when logging is off."""

from __future__ import annotations

import json
import tempfile

import numpy as np
import pytest
import torch
from script_utils import load_script
from transformers import TrainingArguments

from longrange import CompressiveConfig, CompressiveForCausalLM
from longrange.trainer import MEMORY_TRAINER_SUPPORTED, MemoryTrainer, StreamWindows

# both use MemoryTrainer, which refuses transformers < 5.17 (README, Supported versions)
needs_memory_trainer = pytest.mark.skipif(
    not MEMORY_TRAINER_SUPPORTED, reason="MemoryTrainer needs transformers >= 5.17 (it refuses this version)"
)


@needs_memory_trainer
def test_check_long_runs_quick_mode_samples_rss_along_each_run(tmp_path):
    script = load_script("check_long_runs")
    out = tmp_path / "long_runs.json"
    report = script.main(["--quick", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["command"].endswith("--quick --json " + str(out)) and report["date"]
    generation = report["generation"]
    assert generation["new_tokens"] == 300
    assert list(generation["rss_mb_at_tokens"]) == list(range(0, 301, 50))
    assert all(v > 0 for v in generation["rss_mb_at_tokens"].values())
    for kind in ("compressive", "sinkhorn"):
        run = report[f"training_{kind}"]
        assert run["steps"] == 20 and list(run["rss_mb_at_steps"]) == [0, 5, 10, 15, 20]
        assert set(run["growth"]) == {"fit_from", "rss_mb_first", "rss_mb_last", "rss_mb_max", "kib_per_unit"}
    assert "MemoryTrainer" in report["training_compressive"]["what"]


@needs_memory_trainer
def test_trainer_keeps_running_sums_of_the_loss_parts_not_one_tensor_per_step():
    # found by the long runs' review: with logging off, the parts since the last log were lists that grew by two
    # tensors per step for the whole run
    torch.manual_seed(0)
    config = CompressiveConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=32, segment_length=8, mem_len=8, c_mem_len=4, compression_rate=2)  # fmt: skip
    ids = np.random.default_rng(0).integers(0, 64, size=12 * 2 * 16 + 16)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, max_steps=12, per_device_train_batch_size=2, logging_strategy="no", save_strategy="no",
            report_to="none", use_cpu=True, disable_tqdm=True, remove_unused_columns=False,
            train_sampling_strategy="sequential",
        )  # fmt: skip
        trainer = MemoryTrainer(model=CompressiveForCausalLM(config), args=args, train_dataset=StreamWindows(ids, 16))
        trainer.train()
    parts = trainer._aux["train"]
    assert set(parts) == {"lm_loss", "reconstruction_loss"}
    for total, count in parts.values():
        assert count == 12 and total.dim() == 0  # one running sum per part, however long the run
