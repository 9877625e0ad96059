#!/usr/bin/env python
"""Write the compatibility fixture `tests/fixtures/compat/`: tiny saved models of both families, each with fixed
inputs, the logits the code gave for them and (causal models) the greedy tokens of a cached `generate()`.
`tests/test_compat_fixture.py` reloads every folder with the current code and requires the same numbers.

Run it from a checkout of the code whose behaviour is to be recorded, e.g. a worktree of an older commit, so that
edits in progress elsewhere do not leak in:

    git worktree add /tmp/lr-base <commit>
    PYTHONPATH=/tmp/lr-base python tools/make_compat_fixture.py --expect-package /tmp/lr-base
    git worktree remove /tmp/lr-base

Each folder `<name>/` holds what `save_pretrained` writes (`config.json`, `generation_config.json`,
`model.safetensors`; the copied modeling files are removed: the test loads with the package's classes, and the
files would only record old code), `expected.safetensors` (`input_ids`, `attention_mask`, `logits`, and for causal
models `prompt_ids`, `prompt_mask`, `generated`) and `expected.json` (the options, the greedy tokens as lists, and
where and with which versions the numbers were made). Everything runs on the CPU in float32 with one thread.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "tests" / "fixtures" / "compat"
NEW_TOKENS = 8

COMPRESSIVE_BASE = dict(
    vocab_size=32,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=32,
    segment_length=8,
    mem_len=8,
    c_mem_len=4,
    compression_rate=2,
)
SINKHORN_BASE = dict(
    vocab_size=32,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=32,
    bucket_size=8,
    max_position_embeddings=64,
)

# name -> (family, head, options on top of the family's base); head: "causal" or "masked"
CASES: dict[str, tuple[str, str, dict]] = {
    "compressive_conv1d_pre": ("compressive", "causal", {}),
    "compressive_conv1d_post_autoencoding": (
        "compressive",
        "causal",
        dict(layer_norm_position="post", reconstruction_loss="autoencoding"),
    ),
    "compressive_dilated_conv_post": (
        "compressive",
        "causal",
        dict(compression_function="dilated_conv", layer_norm_position="post"),
    ),
    "compressive_most_used_pkm": (
        "compressive",
        "causal",
        dict(compression_function="most_used", reconstruction_loss="none", pkm_layers=[2], pkm_num_keys=4, pkm_heads=2),
    ),
    "sinkhorn_causal_default": ("sinkhorn", "causal", dict(causal=True)),
    "sinkhorn_causal_local_reversible": (
        "sinkhorn",
        "causal",
        dict(causal=True, n_local_attn_heads=1, reversible=True, weight_tie=False, ff_chunks=2),
    ),
    "sinkhorn_causal_weight_tie": ("sinkhorn", "causal", dict(causal=True, weight_tie=True)),
    "sinkhorn_causal_factorized_dim_head_pkm": (
        "sinkhorn",
        "causal",
        dict(causal=True, emb_dim=8, dim_head=8, ff_glu=True, pkm_layers=[2], pkm_num_keys=4, pkm_heads=2),
    ),
    "sinkhorn_causal_position_rows_tied": (
        "sinkhorn",
        "causal",
        dict(causal=True, axial_position_embeddings=False, tie_word_embeddings=True, initializer_range=0.02),
    ),
    "sinkhorn_causal_reference_options": (
        "sinkhorn",
        "causal",
        dict(
            causal=True,
            emb_dim=8,
            norm_after_project_out=True,
            lm_head_bias=True,
            causal_key_summary="running_mean_sum",
            causal_null_score="zero",
            null_bucket_copies=True,
            shifted_heads_skip_first_bucket=True,
            weight_routed_keys=True,
            sequential_routing_weights=True,
        ),
    ),
    "sinkhorn_masked_sortcut": ("sinkhorn", "masked", dict(n_sortcut=2)),
    "sinkhorn_masked_local_simple_sort": (
        "sinkhorn",
        "masked",
        dict(n_local_attn_heads=2, use_simple_sort_net=True, route_own_bucket=True),
    ),
}


def cpu_model() -> str:
    """The CPU's model name, as tests/test_compat_fixture.py compares it (Linux: /proc/cpuinfo)."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def build(family: str, head: str, options: dict):
    from longrange import (
        CompressiveConfig,
        CompressiveForCausalLM,
        SinkhornConfig,
        SinkhornForCausalLM,
        SinkhornForMaskedLM,
    )

    if family == "compressive":
        return CompressiveForCausalLM(CompressiveConfig(**COMPRESSIVE_BASE, **options))
    config = SinkhornConfig(**SINKHORN_BASE, **options)
    return (SinkhornForCausalLM if head == "causal" else SinkhornForMaskedLM)(config)


def inputs(head: str, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    """Two rows; the second padded (left for causal models, right for masked ones), so both code paths are seen.
    Lengths are not multiples of the segment or bucket size (40 tokens: 5 Compressive segments, with evictions and
    compression; 37 or 45: a padded last bucket)."""
    g = torch.Generator().manual_seed(seed)
    length = 40 if head == "causal" else 45
    ids = torch.randint(0, vocab_size, (2, length), generator=g)
    mask = torch.ones_like(ids)
    if head == "causal":
        mask[1, :3] = 0
    else:
        mask[1, -6:] = 0
    out = {"input_ids": ids, "attention_mask": mask}
    if head == "causal":
        prompt = torch.randint(0, vocab_size, (2, 12), generator=g)
        prompt_mask = torch.ones_like(prompt)
        prompt_mask[1, :3] = 0
        out.update(prompt_ids=prompt, prompt_mask=prompt_mask)
    return out


def package_commit(package_dir: Path) -> str | None:
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=package_dir, capture_output=True, text=True, check=True, timeout=30
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "longrange"], cwd=package_dir, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() + ("-dirty" if dirty else "")


def make(name: str, family: str, head: str, options: dict, out: Path, provenance: dict) -> int:
    from safetensors.torch import save_file

    torch.manual_seed(sum(map(ord, name)))
    model = build(family, head, options).eval()
    folder = out / name
    if folder.exists():
        shutil.rmtree(folder)
    model.save_pretrained(folder)
    for code in folder.glob("*.py"):  # the copied modeling files: not needed by the test, and would go stale
        code.unlink()
    data = inputs(head, model.config.vocab_size, seed=len(name))
    with torch.no_grad():
        logits = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits
    tensors = dict(data, logits=logits.contiguous())
    record = {"family": family, "head": head, "options": options, **provenance}
    if head == "causal":
        with torch.no_grad():
            generated = model.generate(
                data["prompt_ids"],
                attention_mask=data["prompt_mask"],
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                use_cache=True,
                pad_token_id=0,
            )
        tensors["generated"] = generated
        record["greedy_new_tokens"] = generated[:, data["prompt_ids"].shape[1] :].tolist()
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "expected.safetensors")
    (folder / "expected.json").write_text(json.dumps(record, indent=1) + "\n")
    return sum(p.stat().st_size for p in folder.iterdir())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="fixture folder (default %(default)s)")
    parser.add_argument(
        "--expect-package",
        type=Path,
        default=None,
        help="refuse to run unless `longrange` is imported from this checkout (e.g. the base worktree)",
    )
    parser.add_argument("--cases", nargs="*", default=None, help="only these case names (default: all)")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    import transformers

    import longrange

    package_dir = Path(longrange.__file__).resolve().parents[1]
    print(f"longrange from {Path(longrange.__file__).resolve()}")
    if args.expect_package is not None and package_dir != args.expect_package.resolve():
        print(f"error: longrange imported from {package_dir}, not {args.expect_package}", file=sys.stderr)
        return 2
    provenance = {
        "made_with": {
            "longrange_commit": package_commit(package_dir),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu": cpu_model(),  # the same instruction set on another vendor's CPU can round differently
            "threads": torch.get_num_threads(),
        }
    }
    names = args.cases or list(CASES)
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {sorted(CASES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    total = 0
    for name in names:
        family, head, options = CASES[name]
        size = make(name, family, head, options, args.out, provenance)
        total += size
        print(f"{name:45s} {size / 1024:7.1f} KiB")
    print(f"{'total':45s} {total / 1024:7.1f} KiB in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
