"""longrange train: exact resume, accumulation = data parallelism, carried memories, the main-job command."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from longrange.cache_compressive import CompressiveMemoryCache
from longrange.commands import train

REPO = Path(__file__).resolve().parents[1]
os.environ.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
torch.set_num_threads(1)


def child_env() -> dict[str, str]:
    """The environment for a subprocess, taken when it starts (it carries the read guard of the running test)."""
    return {**os.environ, "OMP_NUM_THREADS": "1"}  # tiny models on a shared 2-core machine: one thread each


TINY = {
    "compressive": [
        "hidden_size=32",
        "num_hidden_layers=2",
        "num_attention_heads=2",
        "intermediate_size=64",
        "segment_length=16",
        "mem_len=16",
        "c_mem_len=8",
        "compression_rate=2",
    ],
    "sinkhorn": [
        "hidden_size=32",
        "num_hidden_layers=2",
        "num_attention_heads=2",
        "intermediate_size=64",
        "bucket_size=8",
        "max_position_embeddings=64",
    ],
}


def run(output_dir, data, *extra, model="compressive", config=()):
    """One in-process run of longrange train on the generated play text with a tiny model (Accelerate state reset)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    argv = [
        "--model", model, "--data", str(data), "--window", "32", "--batch_size", "2",
        "--eval_every", "0", "--eval_tokens", "1024", "--num_samples", "0", "--learning_rate", "3e-3",
        "--output_dir", str(output_dir), "--config", *TINY[model], *config, *extra,
    ]  # fmt: skip
    return train.main(argv)


def weights(output_dir) -> dict[str, torch.Tensor]:
    return load_file(Path(output_dir) / "model" / "model.safetensors")


@pytest.mark.parametrize(
    "model,config",
    [("compressive", ["hidden_dropout=0.1", "attention_dropout=0.1"]), ("sinkhorn", ["ff_dropout=0.1"])],
)
def test_resume_from_a_checkpoint_gives_the_uninterrupted_weights(tmp_path, play_file, model, config):
    # dropout on: the resumed run must also restore the random number generators to match
    common = ["--max_steps", "4", "--gradient_accumulation_steps", "2", "--save_every", "2"]
    whole = run(tmp_path / "whole", play_file, *common, model=model, config=config)
    assert (tmp_path / "whole" / "checkpoints" / "step_2").is_dir()
    resumed = run(
        tmp_path / "resumed",
        play_file,
        *common,
        "--resume_from",
        str(tmp_path / "whole" / "checkpoints" / "step_2"),
        model=model,
        config=config,
    )
    assert whole["steps"] == resumed["steps"] == 4
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "resumed")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # the check can fail: the weights at the checkpoint (two steps fewer) differ from the final ones
    at_checkpoint = load_file(tmp_path / "whole" / "checkpoints" / "step_2" / "model.safetensors")
    assert any(not torch.equal(a[n], at_checkpoint[n]) for n in a)


@pytest.mark.parametrize(
    "saved,resumed",
    [(("4", "1"), ("2", "2")), (("2", "2"), ("1", "4")), (("1", "4"), ("4", "1"))],
    ids=["4 rows -> 2 x 2", "2 x 2 -> 1 x 4", "1 x 4 -> 4 rows"],
)
def test_resume_with_other_accumulation_and_rows_continues_the_carried_memories(tmp_path, play_file, saved, resumed):
    """The same global batch spread otherwise (rows per micro-step x accumulation steps): the resumed run regroups
    the carried memories by stream lane and ends with the uninterrupted run's weights."""

    def layout(rows_and_steps):
        rows, steps = rows_and_steps
        return ["--batch_size", rows, "--gradient_accumulation_steps", steps]

    common = ["--max_steps", "4", "--save_every", "2"]
    run(tmp_path / "whole", play_file, *common, *layout(saved))
    checkpoint = tmp_path / "whole" / "checkpoints" / "step_2"
    run(tmp_path / "resumed", play_file, *common, *layout(resumed), "--resume_from", str(checkpoint))
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "resumed")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5, msg=name)
    # the memories mattered: resumed from empty memories, the same steps give other weights
    run(tmp_path / "afresh", play_file, *common, *layout(resumed), "--resume_from", str(checkpoint), "--no-carry_cache")
    c = weights(tmp_path / "afresh")
    assert any(not torch.allclose(a[n], c[n], rtol=0, atol=1e-4) for n in a)


def test_resume_reads_the_carried_memories_of_older_checkpoints(tmp_path, play_file):
    """Checkpoints written before the lanes were recorded hold a list of cache objects per process."""
    common = ["--max_steps", "4", "--save_every", "2", "--batch_size", "2", "--gradient_accumulation_steps", "2"]
    run(tmp_path / "whole", play_file, *common)
    checkpoint = tmp_path / "whole" / "checkpoints" / "step_2"
    saved = torch.load(checkpoint / "stream_cache_rank0.pt", weights_only=True)
    older = [CompressiveMemoryCache.from_state_dict(state) for state in saved["caches"]]
    torch.save(older, checkpoint / "stream_cache_rank0.pt")
    run(tmp_path / "resumed", play_file, *common, "--resume_from", str(checkpoint))
    a, b = weights(tmp_path / "whole"), weights(tmp_path / "resumed")
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("other", [["--batch_size", "2"], ["--window", "64"]], ids=["global batch", "window"])
def test_resume_refuses_other_lanes_when_carrying_memories(tmp_path, play_file, other):
    run(tmp_path / "whole", play_file, "--max_steps", "2", "--batch_size", "4")
    checkpoint = str(tmp_path / "whole" / "checkpoints" / "step_2")
    with pytest.raises(SystemExit, match=r"global batch of 4 rows .* of 32 tokens, this run's is .*--window 32 "):
        run(tmp_path / "other", play_file, "--max_steps", "4", "--batch_size", "4", *other, "--resume_from", checkpoint)


def test_resume_without_memories_takes_another_global_batch(tmp_path, play_file, capsys):
    run(tmp_path / "whole", play_file, "--max_steps", "2", "--batch_size", "4", model="sinkhorn")
    checkpoint = str(tmp_path / "whole" / "checkpoints" / "step_2")
    resumed = run(tmp_path / "other", play_file, "--max_steps", "4", "--resume_from", checkpoint, model="sinkhorn")
    assert resumed["steps"] == 4
    assert (
        "global batch of 2 rows (1 processes x 1 accumulation steps x 2 rows) of 32 tokens instead of 4 rows"
        in capsys.readouterr().out
    )


def test_accumulation_over_rows_equals_one_bigger_batch(tmp_path, play_file):
    # the single-process twin of the two-process test: 2 micro-steps of 2 rows == 1 step of 4 rows (memories carried)
    run(tmp_path / "big", play_file, "--max_steps", "3", "--batch_size", "4")
    run(tmp_path / "acc", play_file, "--max_steps", "3", "--batch_size", "2", "--gradient_accumulation_steps", "2")
    a, b = weights(tmp_path / "big"), weights(tmp_path / "acc")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5)


def test_streaming_training_carries_the_memory_across_steps(tmp_path, play_file):
    run(tmp_path / "carry", play_file, "--max_steps", "3", "--save_every", "0")
    saved = torch.load(
        tmp_path / "carry" / "checkpoints" / "step_3" / "stream_cache_rank0.pt", weights_only=True, map_location="cpu"
    )
    assert saved["lanes"] == [[0, 1]]  # one accumulation micro-step -> one carried memory, of the stream's 2 lanes
    (state,) = saved["caches"]
    cache = CompressiveMemoryCache.from_state_dict(state)
    assert cache.get_seq_length() == 3 * 32  # every token of the three steps went through the memory
    layer = cache.layers[0]
    assert layer.mem.shape[:2] == (2, 16) and not layer.mem.requires_grad  # full memory, detached
    assert layer.c_mem.shape[1] > 0  # compression has started
    # the memory is used: without carrying it, the same data gives other weights
    run(tmp_path / "fresh", play_file, "--max_steps", "3", "--no-carry_cache")
    a, b = weights(tmp_path / "carry"), weights(tmp_path / "fresh")
    assert any(not torch.equal(a[n], b[n]) for n in a)


def test_streamed_rows_are_contiguous_text_and_the_model_reads_its_memory(play_file):
    from transformers import AutoConfig, AutoModelForCausalLM

    import longrange  # noqa: F401
    from longrange.data import StreamBatcher

    raw = play_file.read_bytes()[:20_000]
    batcher = StreamBatcher(np.frombuffer(raw, dtype=np.uint8).astype(np.int64), 32, 2)
    first, second = batcher.batch(0), batcher.batch(1)
    lane = len(raw) // 2
    for b in range(2):
        assert bytes(first[b].tolist()) + bytes(second[b].tolist()) == raw[b * lane : b * lane + 64]
    fields = dict(item.split("=") for item in TINY["compressive"])
    config = AutoConfig.for_model("compressive", vocab_size=259, **{k: int(v) for k, v in fields.items()})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        carried = model(input_ids=first, use_cache=True).cache
        with_memory = model(input_ids=second, cache=carried, use_cache=True).logits
        without = model(input_ids=second, use_cache=True).logits
        together = model(input_ids=torch.cat([first, second], 1)).logits[:, 32:]
    assert not torch.allclose(with_memory, without)
    torch.testing.assert_close(with_memory, together, rtol=1e-4, atol=1e-4)


def test_bad_window_and_bad_data_fail_before_training(tmp_path, play_file):
    with pytest.raises(ValueError, match="shorter than one segment_length"):
        run(tmp_path / "w", play_file, "--max_steps", "1", "--window", "8")
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        train.main(["--data", str(tmp_path / "missing.txt"), "--output_dir", str(tmp_path / "m"), "--max_steps", "1"])
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        train.main(["--data", str(tmp_path / "empty.txt"), "--output_dir", str(tmp_path / "e"), "--max_steps", "1"])


def test_non_utf8_bytes_train_with_the_byte_tokenizer(tmp_path):
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, 40_000, dtype=np.uint8).tobytes()  # mostly invalid UTF-8
    path = tmp_path / "noise.bin"
    path.write_bytes(raw)
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    result = train.main(["--data", str(path), "--window", "32", "--batch_size", "2", "--max_steps", "2",
                         "--eval_tokens", "512", "--num_samples", "1", "--sample_tokens", "8",
                         "--output_dir", str(tmp_path / "out"), "--config", *TINY["compressive"]])  # fmt: skip
    assert result["steps"] == 2 and np.isfinite(result["metrics"]["bits_per_byte"])
    # random bytes carry 8 bits each: an untrained model cannot beat that by much
    assert result["metrics"]["bits_per_byte"] > 7.5


def test_main_job_command_writes_folder_plot_and_samples(tmp_path):
    # the README's main job (`longrange train`) with a step limit; everything else at its defaults
    out = tmp_path / "main-job"
    cmd = [sys.executable, "-m", "longrange", "train", "--max_steps", "3", "--eval_tokens", "4096", "--sample_tokens", "24",
           "--output_dir", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = out / "model"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"):
        assert (folder / name).is_file(), name
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    samples = (out / "samples.txt").read_text()
    assert samples.count("=== sample") == 3 and "prompt 'def '" in samples
    assert "=== sample 1" in proc.stdout and "done: 3 steps" in proc.stdout
    # the progress bar ends on the summary's figures: tokens/s over the run and the last step's validation
    summary = re.search(r"done: 3 steps, ([\d,]+) tokens/s; validation ([\d.]+) bits/byte", proc.stdout)
    bar = re.findall(r"tok/s=([\d,]+)(?:, rec=[\d.]+)?, val_bpb=([\d.]+)", proc.stderr)[-1]
    assert bar[0] == summary[1] and bar[1] == f"{float(summary[2]):.3f}", (bar, summary.groups())
    card = (folder / "README.md").read_text()
    assert "Rae et al., 2019" in card and "First Citizen" not in card and "# the start of the training text" in card
    metrics = json.loads((out / "metrics.json").read_text())
    assert np.isfinite(metrics["bits_per_byte"]) and np.isfinite(metrics["test_bits_per_byte"])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import longrange  # noqa: F401

    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert model.config.model_type == "compressive" and len(tokenizer) == model.config.vocab_size


@pytest.mark.slow
@pytest.mark.parametrize("model", ["compressive", "sinkhorn"])
def test_two_processes_equal_one_process_with_accumulation(tmp_path, play_file, model):
    args = ["-m", "longrange", "train", "--model", model, "--data", str(play_file), "--window", "32", "--batch_size", "2",
            "--max_steps", "3", "--eval_every", "0", "--eval_tokens", "1024", "--num_samples", "0", "--cpu",
            "--learning_rate", "3e-3", "--config", *TINY[model]]  # fmt: skip
    # `--multi_gpu` selects accelerate's torchrun launcher (two real processes); the script's `--cpu` makes them CPU
    # processes joined by gloo. (`accelerate launch --cpu --num_processes 2` would need mpirun.)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]  # fmt: skip
    env = {**child_env(), "ACCELERATE_USE_CPU": "1"}
    two = subprocess.run([*launch, *args, "--output_dir", str(tmp_path / "two")], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    one = subprocess.run([sys.executable, *args, "--gradient_accumulation_steps", "2", "--output_dir",
                          str(tmp_path / "one")], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    metrics = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert metrics["processes"] == 2 and metrics["replica_max_difference"] == 0.0  # both ranks hold the same weights
    a, b = weights(tmp_path / "two"), weights(tmp_path / "one")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_resume_with_another_number_of_processes_continues_the_carried_memories(tmp_path, play_file):
    """Checkpoints of one process with 2 accumulation steps and of two processes, each resumed by the other layout
    (the same global batch): the memories of each process's rows regroup by stream lane, and the resumed runs end
    with the weights of the run that saved the checkpoint."""
    args = ["-m", "longrange", "train", "--data", str(play_file), "--window", "32", "--batch_size", "2",
            "--max_steps", "4", "--save_every", "2", "--eval_every", "0", "--eval_tokens", "1024",
            "--num_samples", "0", "--cpu", "--learning_rate", "3e-3", "--config", *TINY["compressive"]]  # fmt: skip
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]  # fmt: skip
    layouts = {"one": [sys.executable, *args, "--gradient_accumulation_steps", "2"], "two": [*launch, *args]}
    env = {**child_env(), "ACCELERATE_USE_CPU": "1"}

    def train_run(name, layout, *extra):
        done = subprocess.run([*layouts[layout], "--output_dir", str(tmp_path / name), *extra], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]

    for saved, resumed in (("one", "two"), ("two", "one")):
        train_run(saved, saved)
        train_run(f"{saved}-resumed", resumed, "--resume_from", str(tmp_path / saved / "checkpoints" / "step_2"))
        a, b = weights(tmp_path / saved), weights(tmp_path / f"{saved}-resumed")
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5, msg=f"{saved} -> {resumed}: {name}")
    assert len(list((tmp_path / "two" / "checkpoints" / "step_2").glob("stream_cache_rank*.pt"))) == 2


def test_learning_rate_warms_up_linearly_then_follows_a_cosine_to_the_floor():
    from longrange.training import warmup_cosine

    factor = warmup_cosine(warmup_steps=4, total_steps=20, min_ratio=0.1)
    # hand-computed: (step + 1) / 4 during warm-up; then 0.1 + 0.9 * (1 + cos(pi * (step - 4) / 16)) / 2
    expected = {0: 0.25, 1: 0.5, 3: 1.0, 4: 1.0, 12: 0.55, 20: 0.1, 30: 0.1}
    for step, value in expected.items():
        assert factor(step) == pytest.approx(value), step


@pytest.mark.parametrize("warmup, total, floor", [(4, 20, 0.1), (60, 1200, 0.1), (1, 100, 0.0), (12, 250, 0.05)])
def test_learning_rate_decay_is_transformers_cosine_with_min_lr(warmup, total, floor):
    # the schedule is transformers' from the end of the warm-up to the last step, value for value; the warm-up is
    # one step ahead of transformers' (which trains its first step at 0), and the floor holds past the last step
    from transformers import get_cosine_with_min_lr_schedule_with_warmup

    from longrange.training import warmup_cosine

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    theirs = get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup, total, min_lr_rate=floor).lr_lambdas[0]
    ours = warmup_cosine(warmup, total, floor)
    assert [ours(step) for step in range(warmup, total + 1)] == [theirs(step) for step in range(warmup, total + 1)]
    assert [ours(step) for step in range(warmup)] == [theirs(step + 1) for step in range(warmup)]
    assert theirs(0) == 0.0 and ours(total + total // 2) == floor


@pytest.mark.slow  # inductor compiles forward and backward on the CPU: minutes on 2 busy cores
@pytest.mark.parametrize(
    "model,compile_args",
    [("compressive", ["--compile"]), ("sinkhorn", ["--compile"]), ("compressive", ["--compile", "model"])],
)
def test_compiled_training_matches_eager_training(tmp_path, play_file, model, compile_args):
    # regional (the default: each layer compiled alone) and whole-model compilation; the Compressive model streams,
    # its memory carried from step to step through the compiled layers (several memory lengths: several graphs)
    from torch._dynamo.utils import counters

    common = ["--max_steps", "2", "--save_every", "0", "--batch_size", "2"]
    run(tmp_path / "eager", play_file, *common, model=model)
    torch._dynamo.reset()
    counters.clear()
    run(tmp_path / "compiled", play_file, *common, *compile_args, model=model)
    assert counters["stats"]["unique_graphs"] >= 1  # the training step really went through torch.compile
    torch._dynamo.reset()
    a, b = weights(tmp_path / "eager"), weights(tmp_path / "compiled")
    assert a.keys() == b.keys()  # saved from the uncompiled module: no `_orig_mod.` prefixes
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("model", ["compressive", "sinkhorn"])
def test_compile_option_compiles_each_layer_or_the_whole_model(model):
    # what `--compile` hands Accelerate, followed through its prepare() (torch.compile is lazy: nothing compiles
    # here; the slow test above trains through both)
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from longrange import CompressiveConfig, CompressiveForCausalLM, SinkhornConfig, SinkhornForCausalLM
    from longrange.commands.train import SMALL_CONFIGS, parse_args
    from longrange.commands.train_run import dynamo_plugin

    assert parse_args(["--compile"]).compile == "regional" and parse_args([]).compile is None
    assert parse_args(["--compile", "model"]).compile == "model"
    config_class, model_class = {
        "compressive": (CompressiveConfig, CompressiveForCausalLM),
        "sinkhorn": (SinkhornConfig, SinkhornForCausalLM),
    }[model]
    config = config_class(**{**SMALL_CONFIGS[model], **parse_args(["--model", model, "--config", *TINY[model]]).config})
    for mode in ("regional", "model"):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        net = model_class(config)
        prepared = Accelerator(cpu=True, dynamo_plugin=dynamo_plugin(mode)).prepare(net)
        layers = prepared.model.layers if mode == "regional" else prepared._orig_mod.model.layers
        compiled = [isinstance(layer, torch._dynamo.eval_frame.OptimizedModule) for layer in layers]
        assert compiled == [mode == "regional"] * config.num_hidden_layers, mode
        assert (mode == "model") == isinstance(prepared, torch._dynamo.eval_frame.OptimizedModule)
        assert Accelerator().unwrap_model(prepared, keep_torch_compile=False) is net
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
