"""The user's workflow on saved folders of both models: pipeline, Trainer fine-tuning, evaluation, generation, sharing.

Models are tiny (2 layers, width 32) so every test runs in seconds on 2 CPU cores. Commands are run in-process through
their `main(argv)` (`longrange.commands.<name>`), except the Hub-folder check, which needs a fresh interpreter.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from script_utils import load_command
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

from longrange import CompressiveConfig, CompressiveForCausalLM, SinkhornConfig, SinkhornForCausalLM
from longrange.tokenization import byte_tokenizer, decode_bytes, encode_bytes, train_bpe_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def tiny_model(kind: str, vocab_size: int, special: dict):
    torch.manual_seed(0)
    common = dict(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, **special)
    if kind == "compressive":
        config = CompressiveConfig(
            intermediate_size=64, segment_length=8, mem_len=8, c_mem_len=4, compression_rate=2, **common
        )
        return CompressiveForCausalLM(config)
    config = SinkhornConfig(bucket_size=8, max_position_embeddings=64, causal=True, **common)
    return SinkhornForCausalLM(config)


@pytest.fixture(scope="module")
def play_bytes(play_file) -> bytes:
    return play_file.read_bytes()


@pytest.fixture(scope="module")
def small_text(tmp_path_factory, play_bytes) -> Path:
    path = tmp_path_factory.mktemp("data") / "play_12k.txt"
    path.write_bytes(play_bytes[:12_000])
    return path


@pytest.fixture(scope="module", params=["compressive", "sinkhorn"])
def saved(request, tmp_path_factory) -> Path:
    """A byte-level tiny model of each kind, saved with its tokenizer."""
    tok = byte_tokenizer()
    special = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = tiny_model(request.param, len(tok), special)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


# ---------------------------------------------------------------------------------------------------------------
# Must show 4: pipeline and tokenizer from a saved folder
# ---------------------------------------------------------------------------------------------------------------


def test_pipeline_generates_text_from_saved_folder(saved):
    generator = pipeline("text-generation", model=str(saved))
    out = generator("ROMEO:", max_new_tokens=12, do_sample=False)[0]["generated_text"]
    assert out.startswith("ROMEO:")
    ids = generator.tokenizer(out[len("ROMEO:") :], add_special_tokens=False)["input_ids"]
    assert len(ids) >= 1  # new text, some of it maybe undecodable bytes shown as U+FFFD


def test_saved_folder_tokenizer_round_trips_bytes(saved, play_bytes):
    tok = AutoTokenizer.from_pretrained(saved)
    raw = play_bytes[:300] + b"\xff\xfe\x80 \xe2\x98"  # text, then invalid UTF-8
    assert encode_bytes(tok, raw) == list(raw)
    assert decode_bytes(tok, encode_bytes(tok, raw)) == raw


def test_bpe_tokenizer_in_saved_folder_round_trips_text(tmp_path, play_text):
    text = play_text[:20_000]
    tok = train_bpe_tokenizer([text], vocab_size=320)
    special = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    tiny_model("sinkhorn", len(tok), special).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    sample = text[5000:7000] + " ünïcödé ☃"
    ids = reloaded(sample, add_special_tokens=False)["input_ids"]
    assert len(ids) < len(sample.encode())  # merges applied
    assert reloaded.decode(ids) == sample
    out = pipeline("text-generation", model=str(tmp_path))("KING", max_new_tokens=5, do_sample=False)
    assert out[0]["generated_text"].startswith("KING")


# ---------------------------------------------------------------------------------------------------------------
# Must show 5: Trainer fine-tunes from a saved folder and writes a checkpoint that reloads
# ---------------------------------------------------------------------------------------------------------------


def test_trainer_finetunes_and_checkpoint_reloads(saved, small_text, tmp_path):
    finetune = load_command("finetune")
    out = tmp_path / "ft"
    argv = [str(saved), "--data", str(small_text), "--output_dir", str(out), "--window", "32", "--max_steps", "2"]
    argv += ["--per_device_train_batch_size", "4", "--logging_steps", "1", "--save_steps", "2"]
    argv += ["--learning_rate", "1e-3", "--max_eval_tokens", "256"]
    metrics = finetune.main(argv)

    checkpoint = out / "checkpoint-2"
    assert (checkpoint / "model.safetensors").is_file() and (checkpoint / "trainer_state.json").is_file()
    before = load_file(saved / "model.safetensors")
    after = load_file(out / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)  # training changed the weights

    reloaded = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    assert type(reloaded).__name__ == json.loads((saved / "config.json").read_text())["architectures"][0]
    for name, tensor in reloaded.state_dict().items():
        if name in after:
            torch.testing.assert_close(tensor, after[name], rtol=0, atol=0)
    AutoTokenizer.from_pretrained(checkpoint)  # the tokenizer travels with the checkpoint
    card = (out / "README.md").read_text()  # the longrange model card, with the final evaluation
    assert "## Metrics" in card and f"| eval_accuracy | {metrics['eval_accuracy']:.4g} |" in card

    # evaluation metrics: accuracy in [0, 1], perplexity = exp(mean NLL) computed here from the reloaded model
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0
    history = json.loads((checkpoint / "trainer_state.json").read_text())["log_history"]
    train_logs = [entry for entry in history if "loss" in entry]
    assert len(train_logs) == 2
    if reloaded.config.model_type == "compressive":
        # the two parts of the Compressive loss are logged separately, and sum to the optimised loss
        for entry in train_logs:
            assert {"lm_loss", "reconstruction_loss"} <= entry.keys()
            weight = reloaded.config.reconstruction_loss_weight
            assert entry["loss"] == pytest.approx(entry["lm_loss"] + weight * entry["reconstruction_loss"], rel=1e-3)
        assert "eval_lm_loss" in metrics


@pytest.mark.slow  # three short Trainer runs, one of them two processes: ~1 min on a loaded 2-core machine
def test_finetune_accumulation_and_processes_equal_one_big_batch(tmp_path, play_bytes):
    """1 step of 4 rows = 2 accumulation steps of 2 rows = 2 processes of 2 rows, reconstruction loss included
    (Trainer alone would count the per-call reconstruction mean twice in both), with the same logged losses."""
    data = tmp_path / "four_windows.txt"
    data.write_bytes(play_bytes[:160])  # 90% = 144 bytes = exactly 4 windows of 32: one full batch
    tok = byte_tokenizer()
    tiny_model("compressive", len(tok), {}).save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    common = [str(tmp_path / "base"), "--data", str(data), "--window", "32", "--max_steps", "2", "--logging_steps", "1"]
    common += ["--learning_rate", "1e-2", "--save_steps", "100", "--max_eval_tokens", "0"]
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])  # the repository first, the read guard kept
    env = {**os.environ, "PYTHONPATH": path, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    # `--multi_gpu` picks accelerate's torchrun launcher; ACCELERATE_USE_CPU makes the two processes CPU/gloo ones
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    # the two processes run `longrange finetune` from a script that then reports whether the process group is still
    # open: left open, a gloo group can abort the process as the interpreter shuts down (pytorch#190489). Each rank
    # writes its own file (two ranks printing to one pipe can interleave their lines).
    wrapper = tmp_path / "finetune_then_report.py"
    wrapper.write_text(
        "import os, sys, torch.distributed\nfrom longrange.commands import main\nmain(['finetune', *sys.argv[1:]])\n"
        f"open(os.path.join({str(tmp_path)!r}, 'group-' + os.environ['RANK']), 'w')"
        ".write(str(torch.distributed.is_initialized()))\n"
    )
    commands = {
        "big": [sys.executable, "-m", "longrange", "finetune", *common, "--per_device_train_batch_size", "4"],
        "accumulated": [sys.executable, "-m", "longrange", "finetune", *common, "--per_device_train_batch_size", "2"]
        + ["--gradient_accumulation_steps", "2"],
        "two_processes": [*launch, str(wrapper), *common, "--per_device_train_batch_size", "2"],
    }
    runs = {}
    for name, command in commands.items():
        out = tmp_path / name
        run = subprocess.run([*command, "--output_dir", str(out)], env=env, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        if name == "two_processes":  # both ranks closed it
            assert [(tmp_path / f"group-{rank}").read_text() for rank in (0, 1)] == ["False", "False"]
        history = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())["log_history"]
        runs[name] = (load_file(out / "model.safetensors"), [e for e in history if "loss" in e])
    base = load_file(tmp_path / "base" / "model.safetensors")
    assert any(not torch.equal(base[k], runs["big"][0][k]) for k in base)
    for other in ("accumulated", "two_processes"):
        for key, tensor in runs["big"][0].items():
            # 4 Trainer steps at lr 1e-2 through different summation orders: float32 rounding reaches ~2e-5
            torch.testing.assert_close(runs[other][0][key], tensor, rtol=1e-3, atol=1e-4)
        for big, logged in zip(runs["big"][1], runs[other][1], strict=True):
            for name in ("loss", "lm_loss", "reconstruction_loss"):
                assert logged[name] == pytest.approx(big[name], rel=1e-3), (other, name)


def test_finetune_perplexity_matches_direct_computation(saved, small_text, tmp_path):
    """eval_perplexity equals exp(mean next-token NLL) computed here on the same validation windows."""
    finetune = load_command("finetune")
    out = tmp_path / "ft0"
    argv = [str(saved), "--data", str(small_text), "--output_dir", str(out), "--window", "32", "--max_steps", "1"]
    argv += ["--learning_rate", "0", "--max_eval_tokens", "128", "--save_steps", "100"]
    metrics = finetune.main(argv)
    model = AutoModelForCausalLM.from_pretrained(saved).eval()
    # validation = last 10% of the file by position; the first 128 tokens = 4 windows of 32 bytes
    data = small_text.read_bytes()
    valid = torch.tensor(list(data[int(len(data) * 0.9) :][:128])).view(4, 32)
    with torch.no_grad():
        logits = model(valid, use_cache=False).logits
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), valid[:, 1:].reshape(-1), reduction="none")
    predicted = logits[:, :-1].argmax(-1).reshape(-1)
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(nll.mean().item()), rel=1e-4)
    assert metrics["eval_accuracy"] == pytest.approx((predicted == valid[:, 1:].reshape(-1)).float().mean().item())


def test_finetune_passes_push_to_hub_to_training_arguments(tmp_path):
    finetune = load_command("finetune")
    args = finetune.parse_args(["m", "--output_dir", str(tmp_path), "--push_to_hub", "--hub_model_id", "me/tiny"])
    training_args = finetune.training_arguments(args)
    assert training_args.push_to_hub is True and training_args.hub_model_id == "me/tiny"


def test_finetune_rejects_window_shorter_than_a_segment(saved, small_text, tmp_path):
    finetune = load_command("finetune")
    with pytest.raises(ValueError, match="shorter than one"):
        finetune.main([str(saved), "--data", str(small_text), "--output_dir", str(tmp_path), "--window", "4"])


# ---------------------------------------------------------------------------------------------------------------
# longrange evaluate: same NLL as a direct computation
# ---------------------------------------------------------------------------------------------------------------


def direct_nll(model, ids: torch.Tensor) -> torch.Tensor:
    """Per-token NLL of ids[1:] from ONE forward over the whole sequence (no cache, no windows)."""
    with torch.no_grad():
        logits = model(ids[None], use_cache=False).logits[0]
    return F.cross_entropy(logits[:-1], ids[1:], reduction="none")


def test_evaluate_compressive_cache_equals_one_forward(tmp_path, play_bytes):
    evaluate_script = load_command("evaluate")
    tok = byte_tokenizer()
    model = tiny_model("compressive", len(tok), {})
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    text = tmp_path / "doc.txt"
    text.write_bytes(play_bytes[:123])  # 15 segments of 8 and a partial one: memories compress
    ids = torch.tensor(list(text.read_bytes()))
    expected = direct_nll(model.eval(), ids)
    for chunk in ("12", "64"):  # misaligned with the segments, and several segments per call
        result, scores = evaluate_script.main([str(tmp_path), str(text), "--chunk_length", chunk])
        assert result["method"] == "cache" and result["scored_tokens"] == len(ids) - 1
        torch.testing.assert_close(scores.nll, expected, rtol=1e-4, atol=1e-5)
        assert result["total_nll"] == pytest.approx(expected.sum().item(), rel=1e-5)
        assert result["bits_per_byte"] == pytest.approx(expected.sum().item() / math.log(2) / 123, rel=1e-5)


def test_evaluate_documents_as_rows_of_one_batch_equal_each_alone(tmp_path, play_bytes, capsys):
    """Several documents scored as rows of one batch (files of different lengths: the shorter rows padded; a file
    cut at line breaks) give the bits per byte of scoring them one at a time, and both equal an independent
    computation: one forward over each whole document (no cache, no batch)."""
    evaluate_script = load_command("evaluate")
    tok = byte_tokenizer()
    model = tiny_model("compressive", len(tok), {"pad_token_id": tok.pad_token_id}).eval()
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    files = []
    for i, (begin, end) in enumerate([(0, 150), (200, 260), (300, 410)]):  # 150, 60 and 110 bytes
        files.append(tmp_path / f"doc{i}.txt")
        files[-1].write_bytes(play_bytes[begin:end])
    total_nll = sum(direct_nll(model, torch.tensor(list(f.read_bytes()))).sum().item() for f in files)
    expected = total_nll / math.log(2) / (150 + 60 + 110)
    common = [str(tmp_path / "model"), *map(str, files), "--chunk_length", "24"]
    batched, batched_scores = evaluate_script.main([*common, "--batch_size", "3"])
    assert "tok/s" in capsys.readouterr().err  # the progress bar, with the rate
    serial, serial_scores = evaluate_script.main([*common, "--batch_size", "1", "--no_progress"])
    assert batched["documents"] == 3 and batched["scored_tokens"] == serial["scored_tokens"] == 320 - 3
    assert batched["bits_per_byte"] == pytest.approx(expected, rel=1e-5)
    assert serial["bits_per_byte"] == pytest.approx(expected, rel=1e-5)
    torch.testing.assert_close(batched_scores.nll, serial_scores.nll, rtol=1e-5, atol=1e-6)

    whole = tmp_path / "whole.txt"
    whole.write_bytes(play_bytes[:600])
    pieces = evaluate_script.split_at_lines(whole.read_bytes(), 4)
    assert len(pieces) == 4 and b"".join(pieces) == whole.read_bytes()
    assert all(piece.endswith(b"\n") for piece in pieces[:-1])
    total_nll = sum(direct_nll(model, torch.tensor(list(piece))).sum().item() for piece in pieces)
    for batch in ("4", "1"):
        argv = [str(tmp_path / "model"), str(whole), "--documents", "4", "--batch_size", batch, "--no_progress"]
        result, _ = evaluate_script.main(argv)
        assert result["documents"] == 4
        assert result["bits_per_byte"] == pytest.approx(total_nll / math.log(2) / 600, rel=1e-5)


def test_evaluate_sinkhorn_scores_each_token_once(tmp_path, play_bytes):
    evaluate_script = load_command("evaluate")
    tok = byte_tokenizer()
    model = tiny_model("sinkhorn", len(tok), {}).eval()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    text = tmp_path / "doc.txt"
    text.write_bytes(play_bytes[:100])
    ids = torch.tensor(list(text.read_bytes()))
    json_path = tmp_path / "out.json"
    argv = [str(tmp_path), str(text), "--window", "32", "--stride", "16", "--json", str(json_path)]
    result, scores = evaluate_script.main(argv)
    # windows worked out by hand: (begin, end, first scored token)
    assert scores.windows == [(0, 32, 1), (16, 48, 32), (32, 64, 48), (48, 80, 64), (64, 96, 80), (68, 100, 96)]
    expected = torch.empty(len(ids) - 1)
    for begin, end, first in scores.windows:
        expected[first - 1 : end - 1] = direct_nll(model, ids[begin:end])[first - 1 - begin :]
    torch.testing.assert_close(scores.nll, expected, rtol=1e-4, atol=1e-5)
    assert json.loads(json_path.read_text())["scored_tokens"] == 99

    # a document shorter than one window: padded to the bucket size, still equal to the unpadded forward
    short = tmp_path / "short.txt"
    short.write_bytes(play_bytes[:21])
    _, scores = evaluate_script.main([str(tmp_path), str(short)])
    torch.testing.assert_close(
        scores.nll, direct_nll(model, torch.tensor(list(short.read_bytes()))), rtol=1e-4, atol=1e-5
    )


def test_evaluate_bad_inputs(saved, tmp_path):
    evaluate_script = load_command("evaluate")
    with pytest.raises(FileNotFoundError, match="no such file"):
        evaluate_script.main([str(saved), str(tmp_path / "missing.txt")])
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        evaluate_script.main([str(saved), str(empty)])
    text = tmp_path / "t.txt"
    text.write_bytes(b"\xff\xfe not UTF-8 \x80 at all" * 4)  # byte-level: scored; bits per char undefined
    result, _ = evaluate_script.main([str(saved), str(text), "--method", "sliding", "--window", "32"])
    assert result["bits_per_char"] is None and result["scored_tokens"] == len(text.read_bytes()) - 1
    with pytest.raises(ValueError, match="stride"):
        evaluate_script.main([str(saved), str(text), "--method", "sliding", "--window", "32", "--stride", "32"])


# ---------------------------------------------------------------------------------------------------------------
# longrange generate
# ---------------------------------------------------------------------------------------------------------------


def test_generate_streams_and_matches_greedy(saved, capsys):
    generate = load_command("generate")
    texts = generate.main([str(saved), "--prompt", "KING:", "--max_new_tokens", "8"])
    printed = capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(saved).eval()
    tok = AutoTokenizer.from_pretrained(saved)
    # greedy decoding computed here without generate(): argmax of a full forward, token by token
    ids = tok("KING:", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        for _ in range(8):
            ids = torch.cat([ids, model(ids, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
    expected = tok.decode(ids[0], skip_special_tokens=True)
    assert texts == [expected]
    assert printed.strip() == expected.strip()  # streamed to the terminal

    sampled = generate.main([str(saved), "--prompt", "KING:", "--max_new_tokens", "6", "--do_sample", "--top_k", "5"])
    again = generate.main([str(saved), "--prompt", "KING:", "--max_new_tokens", "6", "--do_sample", "--top_k", "5"])
    assert sampled == again  # same --seed, same sample


class _Loaded:
    """Stands in for AutoModelForCausalLM in longrange generate: loads as it does and keeps what was loaded, with
    the keyword arguments of every generate() call."""

    def __init__(self):
        self.models, self.calls = [], []

    def from_pretrained(self, *args, **kwargs):
        model = AutoModelForCausalLM.from_pretrained(*args, **kwargs)
        generate, calls = model.generate, self.calls

        def recorded(*a, **kw):
            calls.append(kw)
            return generate(*a, **kw)

        model.generate = recorded
        self.models.append(model)
        return model


def test_generate_loads_the_dtype_asked_for_and_can_turn_compilation_off(saved, monkeypatch):
    generate = load_command("generate")
    loaded = _Loaded()
    monkeypatch.setattr(generate, "AutoModelForCausalLM", loaded)
    args = [str(saved), "--prompt", "KING:", "--max_new_tokens", "4", "--no_stream"]
    (text,) = generate.main([*args, "--dtype", "bfloat16", "--compile", "never"])
    assert loaded.models[-1].dtype == torch.bfloat16 and text.startswith("KING:")
    assert loaded.calls[-1]["disable_compile"] is True
    generate.main(args)  # defaults: the saved dtype, and generate()'s own compile rule
    assert loaded.models[-1].dtype == torch.float32
    assert "disable_compile" not in loaded.calls[-1] and "compile_config" not in loaded.calls[-1]


@pytest.mark.slow
def test_generate_compile_always_compiles_on_the_cpu_and_gives_the_eager_text(saved, monkeypatch):
    from torch._dynamo.utils import counters

    generate = load_command("generate")
    args = [str(saved), "--prompt", "KING:", "--max_new_tokens", "10", "--no_stream"]
    eager = generate.main([*args, "--compile", "never"])
    torch._dynamo.reset()
    before = sum(counters["stats"].values())
    try:
        compiled = generate.main([*args, "--compile", "always"])
        assert sum(counters["stats"].values()) > before  # something was compiled
    finally:
        torch._dynamo.reset()
    assert compiled == eager


def test_generate_rejects_bad_options(saved):
    generate = load_command("generate")
    for bad in (["--top_p", "0"], ["--temperature", "0"], ["--max_new_tokens", "0"]):
        with pytest.raises(SystemExit):
            generate.main([str(saved), *bad])


# ---------------------------------------------------------------------------------------------------------------
# Sharing: the prepared upload folder loads without longrange, with the same logits
# ---------------------------------------------------------------------------------------------------------------

FRESH_LOAD = """
import sys
sys.modules["longrange"] = None  # `import longrange` now raises: only the folder's own code can be used
import json, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
results = {}
for folder in sys.argv[1:]:
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    ids = tok("To be, or not to be", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
    results[folder] = {"module": type(model).__module__, "logits": logits.flatten().tolist()}
print(json.dumps(results))
"""


def test_push_to_hub_dry_run_folder_loads_without_longrange(tmp_path):
    push = load_command("push")
    tok = byte_tokenizer()
    prepared, expected = [], {}
    for kind in ("compressive", "sinkhorn"):
        source = tmp_path / kind
        model = tiny_model(kind, len(tok), {}).eval()
        model.save_pretrained(source)
        tok.save_pretrained(source)
        out = push.main([str(source), f"me/tiny-{kind}", "--dry_run", "--out", str(tmp_path / f"upload-{kind}")])
        names = {p.name for p in out.iterdir()}
        assert {"model.safetensors", "config.json", "tokenizer.json", "README.md", f"modeling_{kind}.py"} <= names
        assert not any(name.endswith(".bin") for name in names)  # weights in safetensors only
        config = json.loads((out / "config.json").read_text())
        assert config["auto_map"]["AutoModelForCausalLM"] == f"modeling_{kind}.{type(model).__name__}"
        assert f'from_pretrained("me/tiny-{kind}", trust_remote_code=True)' in (out / "README.md").read_text()
        ids = tok("To be, or not to be", return_tensors="pt")["input_ids"]
        with torch.no_grad():
            expected[str(out)] = model(ids, use_cache=False).logits.flatten()
        prepared.append(str(out))

    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.environ.get("LONGRANGE_READ_GUARD_DIR", "")  # the read guard only: not the repository
    run = subprocess.run(
        [sys.executable, "-c", FRESH_LOAD, *prepared],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    for folder, result in results.items():
        assert not result["module"].startswith("longrange")  # the copied code, not the package
        torch.testing.assert_close(torch.tensor(result["logits"]), expected[folder], rtol=1e-5, atol=1e-5)


def test_push_to_hub_bad_inputs(tmp_path):
    push = load_command("push")
    with pytest.raises(SystemExit, match="owner/name"):
        push.main([str(tmp_path), "no-owner", "--dry_run"])
    with pytest.raises(SystemExit, match="no config.json"):
        push.main([str(tmp_path), "me/model", "--dry_run"])
