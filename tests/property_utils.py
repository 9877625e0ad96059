"""Shared pieces of the property tests (tests/test_properties_*.py): hypothesis profiles and input builders.

Profiles, chosen by the environment variable LONGRANGE_HYPOTHESIS:

- "ci" (default): derandomized (the same examples on every run, so CI is reproducible), `PER_TEST["ci"]` examples
  per property test (a few hundred in all), no example database (nothing written into the repository).
- "large": random examples (a new sample on every run), `PER_TEST["large"]` examples per property test.

LONGRANGE_HYPOTHESIS_EXAMPLES=N overrides the number of examples per property test of either profile. Both profiles
print the reproduction blob of a failure (`@reproduce_failure`), have no deadline (a tiny model still takes tens of
milliseconds) and skip the health checks that a model-building test trips by design (too_slow; a function-scoped
`tmp_path` shared by the examples of the save/load test, each of which writes its own sub-folder).
"""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

PROFILE = os.environ.get("LONGRANGE_HYPOTHESIS", "ci")
PER_TEST = {"ci": 50, "large": 300}
if PROFILE not in PER_TEST:
    raise ValueError(f"LONGRANGE_HYPOTHESIS must be one of {sorted(PER_TEST)}, got {PROFILE!r}")
EXAMPLES = int(os.environ.get("LONGRANGE_HYPOTHESIS_EXAMPLES", PER_TEST[PROFILE]))

_COMMON = dict(
    deadline=None,
    print_blob=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
settings.register_profile("longrange-ci", max_examples=EXAMPLES, derandomize=True, **_COMMON)
settings.register_profile("longrange-large", max_examples=EXAMPLES, derandomize=False, **_COMMON)
# applied per test (not loaded globally: other test files keep hypothesis' defaults)
PROPERTY_SETTINGS = settings(settings.get_profile(f"longrange-{PROFILE}"))

seeds = st.integers(0, 2**16)


def random_ids(generator: torch.Generator, vocab: int, shape: tuple[int, ...], low: int = 0) -> torch.Tensor:
    return torch.randint(low, vocab, shape, generator=generator)


def pad_rows(
    rows: list[torch.Tensor], layout: str, vocab: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Rows of different lengths in one batch. layout "left" / "right": real tokens at the end / start; "both": some
    padding on either side; "scattered": padding slots anywhere (positions drawn from the generator). Padding slots
    hold random token ids (they must not matter). Returns ids, the attention mask and, per row, the indices of its
    real tokens in order."""
    width = max(len(r) for r in rows)
    if layout in ("both", "scattered"):
        width += 3  # room for padding on every row
    ids = random_ids(generator, vocab, (len(rows), width))
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    where = []
    for i, row in enumerate(rows):
        free = width - len(row)
        if layout == "left":
            index = torch.arange(free, width)
        elif layout == "right":
            index = torch.arange(len(row))
        elif layout == "both":
            before = int(torch.randint(0, free + 1, (1,), generator=generator))
            index = torch.arange(before, before + len(row))
        elif layout == "scattered":
            index = torch.randperm(width, generator=generator)[: len(row)].sort().values
        else:
            raise ValueError(layout)
        ids[i, index] = row
        mask[i, index] = 1
        where.append(index)
    return ids, mask, where


def assert_finite_training_step(model: torch.nn.Module, loss: torch.Tensor, optimizer_name: str, forward) -> None:
    """loss.backward() + one optimizer step: finite loss, finite gradients (some non-zero), finite parameters after
    the step, and a finite loss from the updated model (`forward()` recomputes it)."""
    assert loss.dim() == 0 and torch.isfinite(loss), f"loss {loss}"
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads, "no parameter received a gradient"
    bad = [n for n, g in grads.items() if not torch.isfinite(g).all()]
    assert not bad, f"non-finite gradients in {bad}"
    assert any(g.abs().sum() > 0 for g in grads.values()), "every gradient is zero"
    if optimizer_name == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-1, momentum=0.9)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer.step()
    optimizer.zero_grad()
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    assert not bad, f"non-finite parameters after the step: {bad}"
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters()), "the step changed nothing"
    again = forward()
    assert torch.isfinite(again), f"loss after the step {again}"


def greedy_reference(model, ids, mask, result, new_tokens: int, atol: float = 1e-4) -> None:
    """generate()'s cached greedy decoding (`result`, with output_logits) against recomputing the logits of the whole
    prefix without a cache at every step (float32, eval). The prefix follows the tokens generate() chose; each chosen
    token must be the argmax of the uncached logits (a different choice is accepted only between logits tied within
    `atol`, where either is a correct greedy choice)."""
    width = ids.shape[1]
    assert result.sequences.shape == (ids.shape[0], width + new_tokens)
    assert torch.equal(result.sequences[:, :width], ids)
    assert len(result.logits) == new_tokens
    sequence = ids
    for step in range(new_tokens):
        with torch.no_grad():
            logits = model(sequence, attention_mask=mask, use_cache=False).logits[:, -1].float()
        cached = result.logits[step].float()
        torch.testing.assert_close(cached, logits, atol=atol, rtol=1e-4, msg=lambda m, step=step: f"step {step}: {m}")
        chosen = result.sequences[:, width + step]
        best = logits.argmax(-1)
        margin = logits.max(-1).values - logits.gather(1, chosen[:, None])[:, 0]
        assert bool(((chosen == best) | (margin <= atol)).all()), (
            f"step {step}: cached generation chose {chosen.tolist()}, the uncached argmax is {best.tolist()}"
        )
        sequence = torch.cat([sequence, chosen[:, None]], dim=1)
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
