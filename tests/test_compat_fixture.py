"""Saved folders keep their behaviour: every model under `tests/fixtures/compat/` was saved by an earlier version of
the code (`tools/make_compat_fixture.py`, run on a checkout of the commit recorded in its `expected.json`), with
the logits it gave for fixed inputs and, for causal models, the greedy tokens of a cached `generate()`. Reloaded
with the current code, each must give the same logits, bit for bit, and the same tokens.

Bit-identical logits are asked where the numbers can be: the same torch release, CPU instruction set and CPU model
as the run that made them (recorded in `expected.json`), one thread, float32. Elsewhere (e.g. CI's floor
environment, another torch release whose kernels round differently, or another CPU: an AMD EPYC and the recording
machine, both AVX512, differ by up to 5e-7; records made before the CPU model was kept count as another CPU) the
logits must agree to 1e-5 and the tokens exactly.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from longrange import CompressiveForCausalLM, SinkhornForCausalLM, SinkhornForMaskedLM

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "compat"
FOLDERS = sorted(p.name for p in FIXTURE.iterdir() if (p / "expected.json").is_file()) if FIXTURE.is_dir() else []
CLASSES = {
    ("compressive", "causal"): CompressiveForCausalLM,
    ("sinkhorn", "causal"): SinkhornForCausalLM,
    ("sinkhorn", "masked"): SinkhornForMaskedLM,
}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), else what `platform` knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def same_numerics(made_with: dict) -> bool:
    return (
        made_with["torch"] == torch.__version__
        and made_with["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
        and made_with.get("cpu") == cpu_model()
    )


def test_fixture_covers_both_families_and_the_options_under_change():
    records = {name: json.loads((FIXTURE / name / "expected.json").read_text()) for name in FOLDERS}
    families = {(r["family"], r["head"]) for r in records.values()}
    assert families == set(CLASSES), families
    assert any(r["options"].get("weight_tie") for r in records.values()), "a weight_tie=True Sinkhorn model"
    assert all(not list((FIXTURE / name).glob("*.py")) for name in FOLDERS), "the saved code is not kept"
    total = sum(f.stat().st_size for name in FOLDERS for f in (FIXTURE / name).iterdir())
    assert total < 1_000_000, f"the fixture grew to {total} bytes"


@pytest.mark.parametrize("name", FOLDERS)
def test_saved_model_gives_the_recorded_logits_and_tokens(name):
    folder = FIXTURE / name
    record = json.loads((folder / "expected.json").read_text())
    expected = load_file(folder / "expected.safetensors")
    model = CLASSES[record["family"], record["head"]].from_pretrained(folder).eval()
    exact = same_numerics(record["made_with"])

    with torch.no_grad():
        logits = model(input_ids=expected["input_ids"], attention_mask=expected["attention_mask"]).logits
    if exact:
        assert torch.equal(logits, expected["logits"]), (
            f"{name}: logits changed, largest difference {(logits - expected['logits']).abs().max().item():.3g}"
        )
    else:
        torch.testing.assert_close(logits, expected["logits"], atol=1e-5, rtol=1e-5)

    if record["head"] == "causal":
        prompt = expected["prompt_ids"]
        new_tokens = len(record["greedy_new_tokens"][0])
        with torch.no_grad():
            generated = model.generate(
                prompt,
                attention_mask=expected["prompt_mask"],
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                use_cache=True,
                pad_token_id=0,
            )
        assert generated[:, prompt.shape[1] :].tolist() == record["greedy_new_tokens"], name
        assert torch.equal(generated, expected["generated"]), name
