#!/usr/bin/env python
"""Write `tests/fixtures/static_cache/`: Compressive caches in the static (decoding) form, saved with
`CompressiveMemoryCache.state_dict()` by the code of a given commit, and the logits that code gave for the decoding
steps that follow. `tests/test_compressive_io.py` loads each saved cache with the current code and requires the
same logits: a static cache saved by an earlier release keeps decoding as it did, when the layout changed since.

The models are those of the compatibility fixture (`tests/fixtures/compat/compressive_*`): rows left-padded to
different fills, so that the prompt leaves the cache in the static form with rows at different fills; then
`STEPS_BEFORE` decoding steps (the group buffers current) before the cache is saved, and `STEPS_AFTER` steps
recorded after it (at least one segment completion: an eviction). Run it from a checkout of the commit to record:

    git worktree add /tmp/lr-base <commit>
    PYTHONPATH=/tmp/lr-base python tools/make_static_cache_fixture.py --expect-package /tmp/lr-base
    git worktree remove /tmp/lr-base
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "fixtures" / "static_cache"
MODELS = ("compressive_conv1d_pre", "compressive_dilated_conv_post")
STEPS_BEFORE, STEPS_AFTER = 3, 12


def record(name: str, folder: Path) -> dict:
    from longrange import CompressiveForCausalLM

    model = CompressiveForCausalLM.from_pretrained(REPO / "tests" / "fixtures" / "compat" / name).eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 13), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # the second row 5 tokens behind
    tokens = torch.randint(0, model.config.vocab_size, (2, STEPS_BEFORE + STEPS_AFTER), generator=generator)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True)
        for i in range(STEPS_BEFORE):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = model(tokens[:, i : i + 1], attention_mask=mask, cache=out.cache, use_cache=True)
        assert out.cache.is_static
        torch.save(out.cache.state_dict(), folder / f"{name}.pt")
        logits = []
        for i in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = model(tokens[:, i : i + 1], attention_mask=mask, cache=out.cache, use_cache=True)
            logits.append(out.logits[:, -1])
    torch.save({"mask": mask, "tokens": tokens[:, STEPS_BEFORE:], "logits": torch.stack(logits, 1)},
               folder / f"{name}.expected.pt")  # fmt: skip
    return {"cache": f"{name}.pt", "expected": f"{name}.expected.pt", "steps_after": STEPS_AFTER}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--expect-package", type=Path, default=None, help="fail unless longrange is imported here")
    args = parser.parse_args()
    import longrange

    package = Path(longrange.__file__).resolve().parents[1]
    if args.expect_package and package != args.expect_package.resolve():
        raise SystemExit(f"longrange imported from {package}, not {args.expect_package}")
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=package, capture_output=True, text=True).stdout.strip()
    made = {"longrange_commit": commit, "torch": torch.__version__, "cases": {n: record(n, args.out) for n in MODELS}}
    (args.out / "made_with.json").write_text(json.dumps(made, indent=1) + "\n")
    print(json.dumps(made, indent=1))


if __name__ == "__main__":
    main()
