"""lm-evaluation-harness through its own command line, on saved folders, as a user scores a model.

The `lm_eval run --model hf --model_args pretrained=FOLDER,trust_remote_code=True` command runs in a fresh interpreter
where `import longrange` fails (only the folder's own code can load the model) on three local tasks, one per request
type: multiple choice (loglikelihood), bits per byte over documents (rolling loglikelihood, documents longer than the
model's window included) and `generate_until` over a batch of prompts of different lengths (left padding). Every
number it logs is recomputed here from plain forwards of the saved model, one sequence at a time, with no padding:
log-softmax sums, lm-eval's documented windows, a greedy loop without a cache. transformers' Llama beside ours is the
reference behaviour.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from client_utils import TOKENIZER, causal_models, require_client
from transformers import AutoModelForCausalLM

require_client("lm_eval")

MODELS = causal_models(max_positions=64)
QUESTIONS = ["Which fruit?", "Pick the one that grows on a tree, in a garden far away from the city, in spring:", "Q"]
CHOICES = [" apple", " banana split", " kiwi"]
# distinct openings: lm-eval 0.4.13 with `batch_size` > 1 and its `logits_cache` mis-scores documents whose rolling
# windows repeat another's in the batch (Llama too; right with `logits_cache=False`), as cuts of one text would
TEXTS = ["the quick brown fox jumps over the lazy dog. ", "lorem ipsum dolor sit amet. ", "pack my box with jugs! "]
DOCUMENTS = [(text * 20)[:n] for text, n in zip(TEXTS, (30, 150, 300))]  # 150 and 300 exceed a 64-token window
PROMPTS = ["Say it:", "A much longer prompt, to be padded:", "Hi"]
MAX_GEN_TOKS, UNTIL = 12, "o"


def task(name: str, data: Path, **fields) -> str:
    lines = [f"task: {name}", "dataset_path: json", "dataset_kwargs:", "  data_files:", f"    test: {data}"]
    lines += ["test_split: test", *(f"{key}: {value}" for key, value in fields.items())]
    return "\n".join(lines) + "\n"


def write_tasks(folder: Path) -> None:
    rows = {
        "choice": [{"question": q, "choices": CHOICES, "answer": i % 3} for i, q in enumerate(QUESTIONS)],
        "documents": [{"text": text} for text in DOCUMENTS],
        "prompts": [{"prompt": p, "target": "x"} for p in PROMPTS],
    }
    for name, records in rows.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    metric = "metric_list:\n  - metric: {}"
    (folder / "choice.yaml").write_text(
        task("tiny_choice", folder / "choice.jsonl", output_type="multiple_choice", doc_to_text='"{{question}}"',
             doc_to_choice='"{{choices}}"', doc_to_target='"{{answer}}"') + metric.format("acc")
    )  # fmt: skip
    (folder / "rolling.yaml").write_text(
        task("tiny_rolling", folder / "documents.jsonl", output_type="loglikelihood_rolling", doc_to_text='""',
             doc_to_target='"{{text}}"') + metric.format("bits_per_byte")
    )  # fmt: skip
    generation = f'generation_kwargs:\n  until: ["{UNTIL}"]\n  max_gen_toks: {MAX_GEN_TOKS}\n  do_sample: false\n'
    (folder / "generate.yaml").write_text(
        task("tiny_generate", folder / "prompts.jsonl", output_type="generate_until", doc_to_text='"{{prompt}}"',
             doc_to_target='"{{target}}"') + generation + metric.format("exact_match")
    )  # fmt: skip


# lm-eval's own command line, for each folder, in one interpreter where longrange cannot be imported
RUN_CLI = """
import sys
sys.modules["longrange"] = None
from lm_eval.__main__ import cli_evaluate
tasks, out, *folders = sys.argv[1:]
for folder in folders:
    sys.argv = ["lm_eval", "run", "--model", "hf", "--model_args", f"pretrained={folder},trust_remote_code=True",
                "--tasks", "tiny_choice,tiny_rolling,tiny_generate", "--include_path", tasks, "--device", "cpu",
                "--batch_size", "3", "--output_path", f"{out}/{folder.rsplit('/', 1)[-1]}", "--log_samples"]
    cli_evaluate()
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """Saved folders of the three models, and lm-eval's results and logged samples for each."""
    root = tmp_path_factory.mktemp("lm_eval")
    tok = TOKENIZER
    for name, make in MODELS.items():
        torch.manual_seed(0)
        make().save_pretrained(root / name)
        tok.save_pretrained(root / name)
    (root / "tasks").mkdir()
    write_tasks(root / "tasks")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1",
               HF_MODULES_CACHE=str(root / "modules"), HF_DATASETS_CACHE=str(root / "datasets"))  # fmt: skip
    folders = [str(root / name) for name in MODELS]
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(RUN_CLI), str(root / "tasks"), str(root / "out"), *folders],
        env=env, cwd=root, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    logged = {}
    for name in MODELS:
        files = list((root / "out" / name).rglob("*.json*"))
        (results,) = [f for f in files if f.name.startswith("results_")]
        samples = {f.name.split("_2")[0].removeprefix("samples_"): f for f in files if f.name.startswith("samples_")}
        logged[name] = {
            "results": json.loads(results.read_text()),
            **{task: [json.loads(line) for line in f.read_text().splitlines()] for task, f in samples.items()},
        }
    return root, tok, logged


def load(root: Path, name: str):
    """The saved model as this process loads it (longrange's classes for ours): the independent computation."""
    return AutoModelForCausalLM.from_pretrained(root / name).eval()


def token_log_probs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[i + 1] | ids[: i + 1]) for every i, from one forward without padding, in float64."""
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]), use_cache=False).logits[0].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def window(model) -> int:  # lm-eval's window: the position table's length, 2,048 for a model without one
    return getattr(model.config, "max_position_embeddings", None) or 2048


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("name", list(MODELS))
def test_multiple_choice_loglikelihoods_and_accuracy_equal_plain_forwards(harness, name):
    root, tok, logged = harness
    model = load(root, name)
    samples = logged[name]["tiny_choice"]
    assert len(samples) == len(QUESTIONS)
    assert len(encode(tok, QUESTIONS[1] + CHOICES[1])) > 64  # cut from the left to Llama's and Sinkhorn's window
    correct = []
    for sample in samples:
        scores = []
        for request, ((loglikelihood, greedy),) in zip(sample["arguments"].values(), sample["resps"]):
            context, continuation = encode(tok, request["arg_0"]), encode(tok, request["arg_1"])
            ids = (context + continuation)[-(window(model) + 1) :]  # lm-eval keeps the last window + 1 tokens
            with torch.no_grad():
                logits = model(torch.tensor([ids[:-1]]), use_cache=False).logits[0, -len(continuation) :].double()
            expected = torch.log_softmax(logits, -1)[range(len(continuation)), continuation].sum().item()
            assert float(loglikelihood) == pytest.approx(expected, rel=1e-6, abs=1e-5)
            assert (greedy == "True") == (logits.argmax(-1).tolist() == continuation)
            scores.append(expected)
        correct.append(float(scores.index(max(scores)) == sample["doc"]["answer"]))
    accuracy = logged[name]["results"]["results"]["tiny_choice"]["acc,none"]
    assert accuracy == pytest.approx(sum(correct) / len(correct))


@pytest.mark.parametrize("name", list(MODELS))
def test_rolling_loglikelihoods_and_bits_per_byte_equal_plain_forwards(harness, name):
    root, tok, logged = harness
    model = load(root, name)
    length = window(model)
    assert logged[name]["results"]["max_length"] == length  # the position table's length; 2,048 for Compressive
    totals = []
    for sample, text in zip(logged[name]["tiny_rolling"], DOCUMENTS):
        tokens = [tok.bos_token_id, *encode(tok, text)]  # lm-eval predicts the first token from the BOS token
        expected, done = 0.0, 0
        while done < len(tokens) - 1:  # windows predict disjoint runs of up to `length` tokens, each in one forward
            end = min(done + length, len(tokens) - 1)
            start = max(0, end - length)  # a short last window keeps a full window of earlier tokens as context
            expected += token_log_probs(model, tokens[start : end + 1])[done - start :].sum().item()
            done = end
        (loglikelihood,) = sample["resps"][0]
        assert float(loglikelihood) == pytest.approx(expected, rel=1e-6, abs=1e-5)
        totals.append(expected)
    if name == "compressive":  # one window over 38 segments: the memories and compressed memories at work
        assert len(encode(tok, DOCUMENTS[-1])) > 30 * model.config.segment_length
    else:
        assert len(encode(tok, DOCUMENTS[-1])) > 4 * length
    bits = -sum(totals) / (sum(len(d.encode()) for d in DOCUMENTS) * math.log(2))
    reported = logged[name]["results"]["results"]["tiny_rolling"]["bits_per_byte,none"]
    assert reported == pytest.approx(bits, rel=1e-6)


@pytest.mark.parametrize("name", list(MODELS))
def test_generate_until_over_a_left_padded_batch_equals_a_greedy_loop_without_cache(harness, name):
    root, tok, logged = harness
    model = load(root, name)
    samples = logged[name]["tiny_generate"]
    assert len({len(p) for p in PROMPTS}) == len(PROMPTS) == len(samples)  # one batch of 3 lengths: left padding
    for sample in samples:
        ids = encode(tok, sample["doc"]["prompt"])
        prompt_length = len(ids)
        with torch.no_grad():
            for _ in range(MAX_GEN_TOKS):
                ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
                if ids[-1] == tok.eos_token_id:  # the model's configured end of text stops generate()
                    break
        expected = tok.decode(ids[prompt_length:], skip_special_tokens=True).split(UNTIL)[0]
        assert sample["resps"] == [[expected]]
