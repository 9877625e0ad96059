"""MemoryTrainer: Trainer fine-tuning with the Compressive memory carried from batch to batch.

Every check compares against a plain loop written here (lanes cut from the stream by hand, `cache=` passed from one
call to the next, torch AdamW), the training loop of `longrange train --streaming`. Models are tiny and the text is
generated in the test.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainingArguments

from longrange import (
    CompressiveConfig,
    CompressiveForCausalLM,
    CompressiveMemoryCache,
    SinkhornConfig,
    SinkhornForCausalLM,
)
from longrange.trainer import (
    MEMORY_TRAINER_SUPPORTED,
    MemoryTrainer,
    StreamWindows,
    collate_stream_windows,
    memory_from_state,
    memory_state,
)

ROOT = Path(__file__).resolve().parents[1]


# below the version MemoryTrainer supports, only its refusal is tested (test_refuses_unsupported_transformers)
needs_supported = pytest.mark.skipif(
    not MEMORY_TRAINER_SUPPORTED, reason="MemoryTrainer refuses this transformers version (tested below)"
)

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: tiny tensors, one thread


@pytest.mark.skipif(MEMORY_TRAINER_SUPPORTED, reason="the installed transformers is supported")
def test_refuses_unsupported_transformers(tmp_path):
    with pytest.raises(RuntimeError, match="MemoryTrainer needs transformers >="):
        MemoryTrainer(model=tiny_compressive(), args=TrainingArguments(output_dir=str(tmp_path), report_to=[]))


WINDOW = 16  # two segments of 8
LR = 1e-2


def make_ids(n: int, seed: int) -> np.ndarray:
    """ASCII text of `n` bytes: words from a small random vocabulary, so there is something to learn and remember."""
    rng = np.random.default_rng(seed)
    words = [bytes(rng.integers(97, 123, size=int(rng.integers(2, 7))).tolist()) for _ in range(24)]
    text = b" ".join(words[i] for i in rng.integers(0, len(words), size=n))[:n]
    return np.frombuffer(text, dtype=np.uint8).astype(np.int64)


def tiny_compressive() -> CompressiveForCausalLM:
    torch.manual_seed(0)
    config = CompressiveConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        segment_length=8, mem_len=8, c_mem_len=4, compression_rate=2, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    return CompressiveForCausalLM(config)


def lanes_of(ids: np.ndarray, lanes: int, window: int) -> tuple[torch.Tensor, int]:
    """[lanes, steps * window] contiguous lanes of the stream, and the number of whole windows per lane."""
    length = len(ids) // lanes
    steps = length // window
    return torch.as_tensor(ids[: lanes * length].reshape(lanes, length)[:, : steps * window]), steps


@torch.no_grad()
def reference_eval(model, ids: np.ndarray, lanes: int) -> float:
    """Mean next-token loss over the evaluation stream in `lanes` lanes, memory carried from an empty start."""
    model.eval()
    data, steps = lanes_of(ids, lanes, WINDOW)
    cache, total, count = None, 0.0, 0
    for t in range(steps):
        batch = data[:, t * WINDOW : (t + 1) * WINDOW]
        out = model(input_ids=batch, labels=batch, cache=cache, use_cache=True)
        cache = out.cache
        total += out.lm_loss.item() * batch[:, 1:].numel()
        count += batch[:, 1:].numel()
    model.train()
    return total / count


def reference_training(model, ids, lanes, accumulation, steps, eval_ids=None, eval_every=0, eval_lanes=2, carry=True):
    """The streaming loop: micro-step m of every step takes lanes [m*rows, (m+1)*rows) at the step's window, with the
    memory it left at the previous step (empty at each epoch's first window). Returns per-step (loss, lm_loss) and
    the evaluations."""
    data, per_epoch = lanes_of(ids, lanes, WINDOW)
    rows = lanes // accumulation
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    model.train()
    history, evaluations, caches = [], [], [None] * accumulation
    for step in range(steps):
        t = step % per_epoch
        if t == 0:
            caches = [None] * accumulation
        loss_sum = lm_sum = 0.0
        for micro in range(accumulation):
            batch = data[micro * rows : (micro + 1) * rows, t * WINDOW : (t + 1) * WINDOW]
            out = model(input_ids=batch, labels=batch, cache=caches[micro] if carry else None, use_cache=True)
            caches[micro] = out.cache
            (out.loss / accumulation).backward()
            loss_sum += out.loss.item() / accumulation
            lm_sum += out.lm_loss.item() / accumulation
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        history.append((loss_sum, lm_sum))
        if eval_every and (step + 1) % eval_every == 0:
            evaluations.append(reference_eval(model, eval_ids, eval_lanes))
    return history, evaluations


def training_args(out, rows, accumulation, steps, **extra) -> TrainingArguments:
    fields = dict(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=rows, per_device_eval_batch_size=2,
        gradient_accumulation_steps=accumulation, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, optim="adamw_torch", max_grad_norm=1.0, logging_steps=1, report_to="none", use_cpu=True,
        save_strategy="no", disable_tqdm=True, seed=0,
    )  # fmt: skip
    fields.update(extra)
    return TrainingArguments(**fields)


def train_logs(trainer) -> list[dict]:
    return [e for e in trainer.state.log_history if "loss" in e and "train_runtime" not in e]


# 4 lanes of 50 tokens: 3 windows each (2 tokens dropped): 4 steps cross an epoch (memory emptied at step 4)
TRAIN_IDS = make_ids(200, seed=1)
EVAL_IDS = make_ids(100, seed=2)  # 2 lanes of 50 tokens: 3 windows each


def test_stream_windows_layout():
    """Rank-major lanes, micro-steps in order; each batch dealt in turn to ranks holds that rank's lanes."""
    ids = np.arange(400)
    stream = StreamWindows(ids, 10)
    assert len(stream) == 40
    with pytest.raises(RuntimeError, match="not laid out"):
        stream[0]
    laid = stream.laid_out(rows=2, world_size=2, accumulation=2)  # 8 lanes of 50 tokens: 5 windows each
    assert len(laid) == 5 * 8
    loader = torch.utils.data.DataLoader(laid, batch_size=2, collate_fn=collate_stream_windows)
    batches = list(loader)
    for g, batch in enumerate(batches):
        rank, j = g % 2, g // 2  # accelerate deals whole batches to the processes in turn
        step, micro = divmod(j, 2)
        lanes = [(rank * 2 + micro) * 2 + r for r in range(2)]  # rank-major, then micro-step, then row
        expected = torch.stack([torch.arange(lane * 50 + step * 10, lane * 50 + step * 10 + 10) for lane in lanes])
        assert torch.equal(batch["input_ids"], expected) and torch.equal(batch["labels"], expected)
        assert batch["stream"].lanes == tuple(lanes) and batch["stream"].position == step
    # one process with accumulation 2 reads exactly the lanes two processes read side by side
    single = list(
        torch.utils.data.DataLoader(stream.laid_out(2, 1, 2), batch_size=2, collate_fn=collate_stream_windows)
    )
    two = list(torch.utils.data.DataLoader(stream.laid_out(2, 2, 1), batch_size=2, collate_fn=collate_stream_windows))
    assert [b["stream"] for b in single] == [b["stream"] for b in two]


@needs_supported
@pytest.mark.parametrize("rows, accumulation", [(4, 1), (2, 2)])
def test_losses_and_evaluations_equal_streaming_loop(tmp_path, rows, accumulation):
    """Per-step losses, mid-training evaluations (memory carried over the evaluation stream from an empty start) and
    final weights equal the plain streaming loop; one micro-batch of 4 rows = 2 accumulated micro-batches of 2."""
    model = tiny_compressive()
    reference = copy.deepcopy(model)
    trainer = MemoryTrainer(
        model=model,
        args=training_args(tmp_path, rows, accumulation, 4, eval_strategy="steps", eval_steps=2),
        train_dataset=StreamWindows(TRAIN_IDS, WINDOW),
        eval_dataset=StreamWindows(EVAL_IDS, WINDOW),
    )
    trainer.train()
    expected, expected_evals = reference_training(
        reference, TRAIN_IDS, 4, accumulation, 4, eval_ids=EVAL_IDS, eval_every=2, eval_lanes=2
    )
    logs = train_logs(trainer)
    assert len(logs) == 4
    for log, (loss, lm) in zip(logs, expected, strict=True):
        assert log["loss"] == pytest.approx(loss, rel=1e-4)
        assert log["lm_loss"] == pytest.approx(lm, rel=1e-4)
    evals = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
    assert evals == pytest.approx(expected_evals, rel=1e-4)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)

    # the check can fail: without the memory the same loop gives other losses
    no_memory, _ = reference_training(tiny_compressive(), TRAIN_IDS, 4, accumulation, 2, carry=False)
    assert abs(no_memory[1][1] - expected[1][1]) > 1e-3
    no_memory_eval = reference_eval(copy.deepcopy(reference).eval(), EVAL_IDS, 1)
    assert abs(no_memory_eval - reference_eval(reference, EVAL_IDS, 2)) > 1e-4


@needs_supported
def test_memories_survive_save_and_resume(tmp_path, caplog):
    """Resuming from checkpoint-2 (with its saved memories) continues exactly as the uninterrupted run; without the
    memory files the lanes restart from an empty memory (a warning) and the losses differ."""

    def run(out, steps, resume=None):
        trainer = MemoryTrainer(
            model=tiny_compressive(),
            args=training_args(out, 2, 1, steps, save_strategy="steps", save_steps=2),
            train_dataset=StreamWindows(TRAIN_IDS, WINDOW),
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full", 3)
    checkpoint = tmp_path / "full" / "checkpoint-2"
    assert (checkpoint / "stream_memory_rank0.pt").is_file()
    saved = torch.load(checkpoint / "stream_memory_rank0.pt", weights_only=True)
    assert saved["signature"] == {"global_batch": 2, "window": WINDOW, "lane_tokens": 96}
    assert [tuple(s["lanes"]) for s in saved["streams"]] == [(0, 1)]
    assert all(s["position"] == 2 for s in saved["streams"])

    resumed = run(tmp_path / "full", 3, resume=str(checkpoint))
    assert train_logs(resumed)[-1]["loss"] == pytest.approx(train_logs(full)[-1]["loss"], rel=1e-5)
    for p, q in zip(resumed.model.parameters(), full.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)

    bare = tmp_path / "bare" / "checkpoint-2"
    shutil.copytree(checkpoint, bare)
    (bare / "stream_memory_rank0.pt").unlink()
    with caplog.at_level(logging.WARNING, logger="longrange.trainer"):
        rebuilt = run(tmp_path / "bare", 3, resume=str(bare))
    assert "no saved memories" in caplog.text
    assert abs(train_logs(rebuilt)[-1]["lm_loss"] - train_logs(full)[-1]["lm_loss"]) > 1e-4


@needs_supported
@pytest.mark.parametrize(
    "saved,resumed", [((4, 1), (2, 2)), ((2, 2), (1, 4))], ids=["4 rows -> 2 x 2", "2 x 2 -> 1 x 4"]
)
def test_memories_resume_with_other_rows_and_accumulation(tmp_path, saved, resumed):
    """The same 4 lanes spread otherwise over rows per device and accumulation steps: each micro-step regroups the
    saved rows of its lanes, and the resumed run ends as the uninterrupted one (and not as one without memories)."""

    def run(out, layout, resume=None, memories=True):
        trainer = MemoryTrainer(
            model=tiny_compressive(),
            args=training_args(out, *layout, 3, save_strategy="steps", save_steps=2),
            train_dataset=StreamWindows(TRAIN_IDS, WINDOW),
        )
        if not memories:
            (Path(resume) / "stream_memory_rank0.pt").unlink()
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full", saved)
    checkpoint = tmp_path / "full" / "checkpoint-2"
    resumed_run = run(tmp_path / "resumed", resumed, resume=str(checkpoint))
    for p, q in zip(resumed_run.model.parameters(), full.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)  # (float sums in another order)
    bare = tmp_path / "bare" / "checkpoint-2"
    shutil.copytree(checkpoint, bare)
    without = run(tmp_path / "bare", resumed, resume=str(bare), memories=False)
    assert any(
        not torch.allclose(p, q, rtol=1e-5, atol=1e-4)
        for p, q in zip(without.model.parameters(), full.model.parameters())
    )


def test_memory_state_round_trip():
    model = tiny_compressive().eval()
    x = torch.as_tensor(TRAIN_IDS[:64]).view(2, 32)
    cache = model(x[:, :16], use_cache=True).cache
    restored = memory_from_state(memory_state(cache))
    assert restored.seen_tokens == 16 and restored.memory_slots() == cache.memory_slots() > 0
    with torch.no_grad():
        a = model(x[:, 16:], cache=cache, use_cache=True).logits
        b = model(x[:, 16:], cache=restored, use_cache=True).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("croppable", [False, True])
def test_memory_state_round_trip_of_the_static_form(tmp_path, croppable):
    """Rows at different fills (a padded forward, then decoding steps) leave the cache in its static form; a saved
    and reloaded state continues exactly as the cache itself, row by row."""
    model = tiny_compressive().eval()
    x = torch.as_tensor(TRAIN_IDS[:60]).view(2, 30)
    mask = torch.ones_like(x)
    mask[1, :11] = 0  # row 1: 19 real tokens after left padding, row 0: 30
    step = torch.as_tensor(TRAIN_IDS[60:62]).view(2, 1)
    caches = []
    for margin in (0, 8) if croppable else (0,):  # a croppable cache (assisted decoding) decodes the same
        cache = CompressiveMemoryCache(model.config.num_hidden_layers, crop_margin=margin)
        with torch.no_grad():
            cache = model(x, attention_mask=mask, cache=cache, use_cache=True).cache
            caches.append(model(step, attention_mask=torch.cat([mask, torch.ones_like(step)], 1), cache=cache))
    if croppable:
        torch.testing.assert_close(caches[0].logits, caches[1].logits, rtol=1e-5, atol=1e-5)
    cache = caches[-1].cache
    assert cache.is_static and cache.row_lengths()[0] != cache.row_lengths()[1]
    torch.save(memory_state(cache), tmp_path / "memory.pt")
    restored = memory_from_state(torch.load(tmp_path / "memory.pt", weights_only=True))
    assert restored.is_static and restored.row_lengths() == cache.row_lengths()
    assert restored.crop_margin == cache.crop_margin and restored.seen_tokens == cache.seen_tokens
    mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
    with torch.no_grad():
        for t in range(62, 62 + 2 * 12, 2):  # across segment completions of both rows
            token = torch.as_tensor(TRAIN_IDS[t : t + 2]).view(2, 1)
            mask = torch.cat([mask, torch.ones_like(token)], 1)
            a = model(token, attention_mask=mask, cache=cache).logits
            b = model(token, attention_mask=mask, cache=restored).logits
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@needs_supported
def test_memory_trainer_rejects_what_it_cannot_stream(tmp_path):
    torch.manual_seed(0)
    sinkhorn = SinkhornForCausalLM(
        SinkhornConfig(
            vocab_size=128,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            bucket_size=8,
            max_position_embeddings=64,
            causal=True,
        )  # fmt: skip
    )
    with pytest.raises(ValueError, match="keeps a memory"):
        MemoryTrainer(model=sinkhorn, args=training_args(tmp_path, 2, 1, 1), train_dataset=StreamWindows(TRAIN_IDS, 16))
    trainer = MemoryTrainer(model=tiny_compressive(), args=training_args(tmp_path, 2, 1, 1), train_dataset=[1, 2])
    with pytest.raises(TypeError, match="StreamWindows"):
        trainer.get_train_dataloader()
    with pytest.raises(ValueError, match="cannot feed"):  # fewer tokens than one window per lane
        StreamWindows(TRAIN_IDS[:40], WINDOW).laid_out(rows=4)
    trainer.eval_dataset = StreamWindows(TRAIN_IDS[:20], WINDOW)  # 2 evaluation rows: 10 tokens per lane
    with pytest.raises(ValueError, match="lower per_device_eval_batch_size"):
        trainer.get_eval_dataloader()


@needs_supported
@pytest.mark.slow  # two `longrange finetune` runs, one of them two processes: ~1-2 min on a loaded 2-core machine
def test_finetune_carry_memory_two_processes_equal_accumulation(tmp_path):
    """longrange finetune (memory carried by default): 2 processes x 2 rows = 1 process x 2 rows x 2 accumulation
    steps: the same lanes, memories, losses, evaluations and weights."""
    from longrange.tokenization import byte_tokenizer

    data = tmp_path / "generated.txt"
    data.write_bytes(make_ids(1000, seed=3).astype(np.uint8).tobytes())  # 800 train bytes: 4 lanes x 12 windows
    tok = byte_tokenizer()
    torch.manual_seed(0)
    config = CompressiveConfig(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        segment_length=8, mem_len=8, c_mem_len=4, compression_rate=2, hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    CompressiveForCausalLM(config).save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    common = [
        str(tmp_path / "base"),
        "--data",
        str(data),
        "--split",
        "0.8",
        "0.2",
        "--window",
        "16",
        "--max_steps",
        "4",
    ]
    common += ["--learning_rate", "1e-2", "--save_steps", "100", "--eval_steps", "2", "--per_device_train_batch_size"]
    common += ["2", "--logging_steps", "1"]
    pythonpath = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])  # repository, then the read guard
    env = {**os.environ, "PYTHONPATH": pythonpath, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    commands = {  # evaluation: 4 lanes of 50 bytes (3 windows each) either way (2 processes x 2 rows, 1 x 4)
        "accumulated": [sys.executable, "-m", "longrange", "finetune", *common, "--gradient_accumulation_steps", "2"]
        + ["--per_device_eval_batch_size", "4"],
        "two_processes": [*launch, "-m", "longrange", "finetune", *common, "--per_device_eval_batch_size", "2"],
    }
    runs = {}
    for name, command in commands.items():
        out = tmp_path / name
        run = subprocess.run([*command, "--output_dir", str(out)], env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        history = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]
        runs[name] = (load_file(out / "model.safetensors"), history)
    one, two = runs["accumulated"], runs["two_processes"]
    for key, tensor in one[0].items():
        torch.testing.assert_close(two[0][key], tensor, rtol=1e-3, atol=1e-5)
    for name in ("loss", "lm_loss", "reconstruction_loss", "eval_loss"):
        a = [e[name] for e in one[1] if name in e]
        b = [e[name] for e in two[1] if name in e]
        assert len(a) == len(b) > 0 and all(math.isfinite(v) for v in a)
        assert b == pytest.approx(a, rel=1e-3), name
