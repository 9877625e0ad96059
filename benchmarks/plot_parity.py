#!/usr/bin/env python
"""Draw the Sinkhorn parity runs recorded in `docs/benchmarks/sinkhorn_parity.json`: training loss along the
1,200-step schedule, ours against sinkhorn-transformer, one panel per corpus, one line per seed; the legend gives
each run's validation bits per character.

    python benchmarks/plot_parity.py                                   # -> docs/images/sinkhorn_parity.png
    python benchmarks/plot_parity.py --runs h_ --out parity.png   # the runs whose name starts with h_

A run is drawn when its name starts with one of `--runs` and it records `train_loss_nats_mean_of_20_steps_ending_at`
(the mean training loss of the 20 steps ending at each 100th step); its corpus is `data` (runs made before the
second corpus have none: Tiny Shakespeare).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CURVE = "train_loss_nats_mean_of_20_steps_ending_at"
COLORS = {"ours": "tab:blue", "reference": "tab:orange"}
STYLES = ["-", "--", ":", "-."]  # by seed


def curves(record: dict, prefixes: list[str]) -> dict[str, list[dict]]:
    """corpus -> the runs to draw, each {label, side, seed, steps, losses}, in a stable order."""
    by_corpus: dict[str, list[dict]] = {}
    for run in record["runs"]:
        if not run["run"].startswith(tuple(prefixes)) or CURVE not in run:
            continue
        points = sorted((int(step), loss) for step, loss in run[CURVE].items())
        bpc = run.get("validation_bits_per_char")
        label = f"{run['implementation']}, seed {run['seed']}" + (f": {bpc:.3f} bits/char" if bpc is not None else "")
        by_corpus.setdefault(run.get("data", "tinyshakespeare.txt"), []).append(
            {
                "label": label,
                "side": run["side"],
                "seed": run["seed"],
                "steps": [s for s, _ in points],
                "losses": [v for _, v in points],
            }  # fmt: skip
        )
    for runs in by_corpus.values():
        runs.sort(key=lambda r: (r["side"] != "ours", r["seed"]))
    return dict(sorted(by_corpus.items()))


def plot(by_corpus: dict[str, list[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not by_corpus:
        raise SystemExit("no run to draw: check --runs against the record's run names")
    fig, axes = plt.subplots(1, len(by_corpus), figsize=(5.5 * len(by_corpus), 4), squeeze=False)
    for ax, (corpus, runs) in zip(axes[0], by_corpus.items()):
        for run in runs:
            ax.plot(run["steps"], run["losses"], STYLES[run["seed"] % len(STYLES)], color=COLORS[run["side"]],
                    label=run["label"], marker="o", markersize=3)  # fmt: skip
        ax.set_title(corpus)
        ax.set_xlabel("step (batch 8 x 512)")
        ax.set_ylabel("training loss, nats (mean of 20 steps)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, title="validation at step 1,200", title_fontsize=8)
    fig.suptitle("Sinkhorn: longrange vs sinkhorn-transformer 0.11.4, same batches, 6 x 256, bucket 64")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict[str, list[dict]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--record", type=Path, default=REPO / "docs" / "benchmarks" / "sinkhorn_parity.json")
    p.add_argument(
        "--runs", nargs="+", default=["j_", "k_", "h_reference"], help="draw the runs whose name starts with these"
    )
    p.add_argument("--out", type=Path, default=REPO / "docs" / "images" / "sinkhorn_parity.png")
    args = p.parse_args(argv)
    by_corpus = curves(json.loads(args.record.read_text()), args.runs)
    plot(by_corpus, args.out)
    print(f"wrote {args.out}: " + ", ".join(f"{corpus} ({len(runs)} runs)" for corpus, runs in by_corpus.items()))
    return by_corpus


if __name__ == "__main__":
    main()
