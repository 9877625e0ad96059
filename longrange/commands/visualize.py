"""Draw where a saved model looks: a Compressive model's attention mass on its memories along a long document, or
a Sinkhorn model's routing (which key bucket each query bucket chose, per layer and head).

    longrange visualize outputs/compressive-stdlib/model --text_file some_long_file.txt --out attention.png
    longrange visualize outputs/sinkhorn-stdlib/model --text_file some_file.txt --out routing.png

Compressive: the document is fed one segment at a time with the cache carried across (as generation and streaming
evaluation do), with `output_attentions=True`; each point is one segment: the mass of compressed memory, memory
and current segment, averaged over the segment's tokens and the layer's heads.

Sinkhorn: one forward over the first `--max_tokens` tokens (at most max_position_embeddings) with
`output_attentions=True`; one small heat map per layer (rows) and head (columns): row u, column j is the routing
weight with which query bucket u attends key bucket j (1 for every choice of a model without
`weight_routed_values`), its own bucket and local windows not shown; local heads have no routing.

Writes the PNG and, with --json, the numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

import longrange  # noqa: F401  registers the longrange model types with the Auto classes
from longrange.commands import command_parser
from longrange.tokenization import encode_bytes, is_byte_tokenizer

REGIONS = ("compressed memory", "memory", "segment")


def parse_args(argv=None) -> argparse.Namespace:
    p = command_parser("visualize", __doc__, first_paragraph_only=True)
    p.add_argument("model", help="saved Compressive or Sinkhorn model folder (save_pretrained) with its tokenizer")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--text_file", help="a long text file to read")
    source.add_argument("--text", help="the text itself")
    p.add_argument(
        "--max_tokens",
        type=int,
        default=8192,
        help="read at most this many tokens (default 8192; Sinkhorn: at most max_position_embeddings)",
    )
    p.add_argument("--out", default="attention.png", help="PNG to write")
    p.add_argument("--json", help="also write the per-segment figures here")
    p.add_argument("--trust_remote_code", action="store_true", help="run the modeling code saved with the model")
    args = p.parse_args(argv)
    if args.max_tokens < 2:
        p.error(f"--max_tokens must be at least 2, got {args.max_tokens}")
    return args


def attention_mass(model, ids: torch.Tensor) -> list[list[list[float]]]:
    """[segments][layers][regions]: the mean attention mass of each region (REGIONS) per layer and segment."""
    config = model.config
    bounds = [0, config.c_mem_len, config.c_mem_len + config.mem_len]
    cache, figures = None, []
    with torch.no_grad():
        for start in range(0, ids.shape[1], config.segment_length):
            out = model(
                ids[:, start : start + config.segment_length], cache=cache, use_cache=True, output_attentions=True
            )
            cache = out.cache
            per_layer = []
            for weights in out.attentions:  # [1, heads, q, slots]
                regions = torch.tensor_split(weights, bounds[1:], dim=-1)
                per_layer.append([region.sum(-1).mean().item() for region in regions])
            figures.append(per_layer)
    return figures


def sinkhorn_routing(model, ids: torch.Tensor) -> tuple[list, list[list[str]]]:
    """[layers][heads] routing matrices [query buckets][key buckets] of the one row (SinkhornRouting.matrix; a
    causal model's matrices get a first column: the routing weight its query buckets gave to null buckets) and
    [layers][heads] panel labels ("sinkhorn", "shifted" or "local")."""
    config = model.config
    with torch.no_grad():
        out = model(ids, output_attentions=True)
    matrices, labels = [], []
    for routing in out.routing:
        matrix = routing.matrix()[0].float()  # [heads, query buckets, key buckets]
        if config.causal:
            null = routing.weights[0].float().masked_fill(routing.key_buckets[0] >= 0, 0.0).sum(-1, keepdim=True)
            matrix = torch.cat([null, matrix], dim=-1)
        matrices.append(matrix.tolist())
        labels.append(
            [
                "local" if head < config.n_local_attn_heads else ("shifted" if offset else "sinkhorn")
                for head, offset in enumerate(routing.offsets.tolist())
            ]
        )
    return matrices, labels


def plot_routing(matrices, labels, path: Path, title: str, null_column: bool) -> int:
    """A grid of heat maps (layers x heads) of the routing matrices, own buckets outlined; returns the number of
    panels drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.colors
    import matplotlib.pyplot as plt

    layers, heads = len(matrices), len(matrices[0])
    top = max(max(max(row) for row in matrix) for layer in matrices for matrix in layer) or 1.0
    norm = matplotlib.colors.PowerNorm(0.5, vmin=0.0, vmax=top)  # square-root scale: weak choices stay visible
    fig, axes = plt.subplots(layers, heads, figsize=(2.3 * heads + 0.9, 2.3 * layers + 0.7), squeeze=False)
    image = None
    first = 1 if null_column else 0
    for layer in range(layers):
        for head in range(heads):
            ax = axes[layer][head]
            kind = labels[layer][head]
            matrix = matrices[layer][head]
            rows, cols = len(matrix), len(matrix[0])
            image = ax.imshow(matrix, cmap="magma", norm=norm, interpolation="nearest", aspect="auto")
            own = [(u + first, u) for u in range(min(rows, cols - first))]
            ax.scatter(*zip(*own), marker="s", s=6, facecolors="none", edgecolors="#4c9be8", linewidths=0.5)
            if null_column:
                ax.axvline(0.5, color="white", linewidth=0.6)
            ax.set_title(
                f"layer {layer + 1} head {head + 1}" + ("" if kind == "sinkhorn" else f" ({kind})"), fontsize=8
            )
            ax.set_xticks([0] if null_column else [])
            ax.set_xticklabels(["null"] if null_column else [], fontsize=6)
            ax.set_yticks([])
            if kind == "local":
                ax.text(0.5, 0.5, "local window:\nno routing", ha="center", va="center", color="white", fontsize=7,
                        transform=ax.transAxes)  # fmt: skip
            if head == 0:
                ax.set_ylabel("query bucket", fontsize=8)
            if layer == layers - 1:
                ax.set_xlabel("key bucket", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.92, 1))
    fig.colorbar(image, cax=fig.add_axes((0.93, 0.15, 0.015, 0.7)), label="routing weight (square-root scale)")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return layers * heads


def plot(figures, segment_length: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = len(figures[0])
    positions = [(i + 1) * segment_length for i in range(len(figures))]
    fig, axes = plt.subplots(1, layers, figsize=(3.2 * layers, 3.0), sharey=True, squeeze=False)
    for layer, ax in enumerate(axes[0]):
        series = [[segment[layer][r] for segment in figures] for r in range(len(REGIONS))]
        ax.stackplot(positions, *series, labels=REGIONS, colors=("#4c72b0", "#55a868", "#dd8452"))
        ax.set_title(f"layer {layer + 1}")
        ax.set_xlabel("tokens read")
        ax.set_ylim(0, 1)
        ax.set_xlim(positions[0], positions[-1])
    axes[0][0].set_ylabel("attention mass")
    axes[0][-1].legend(loc="lower right", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> list:
    """Compressive: returns [segments][layers][regions]; Sinkhorn: [layers][heads] routing matrices."""
    args = parse_args(argv)
    config = AutoConfig.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    if config.model_type not in ("compressive", "sinkhorn"):
        sys.exit(
            f"longrange visualize draws Compressive and Sinkhorn models; {args.model} is a {config.model_type!r} model"
        )
    auto = AutoModelForMaskedLM if config.model_type == "sinkhorn" and not config.causal else AutoModelForCausalLM
    model = auto.from_pretrained(args.model, trust_remote_code=args.trust_remote_code).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    text = Path(args.text_file).read_text(encoding="utf-8", errors="replace") if args.text_file else args.text
    if is_byte_tokenizer(tokenizer):
        tokens = encode_bytes(tokenizer, text.encode("utf-8"))
    else:
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
    limit = (
        args.max_tokens if config.model_type == "compressive" else min(args.max_tokens, config.max_position_embeddings)
    )
    tokens = tokens[:limit]
    if len(tokens) < 2:
        sys.exit("the text is too short: at least 2 tokens are needed")
    folder = Path(args.model)
    name = folder.parent.name if folder.name == "model" and folder.parent.name else folder.name or str(folder)
    if config.model_type == "sinkhorn":
        matrices, labels = sinkhorn_routing(model, torch.tensor([tokens]))
        title = f"{name}: routing over {len(tokens)} tokens (buckets of {config.bucket_size})"
        panels = plot_routing(matrices, labels, Path(args.out), title, null_column=config.causal)
        print(f"wrote {args.out} ({len(matrices)} layers x {len(matrices[0])} heads = {panels} panels)")
        if args.json:
            Path(args.json).write_text(json.dumps({"heads": labels, "null_column": config.causal, "routing": matrices}))
        return matrices
    figures = attention_mass(model, torch.tensor([tokens]))
    plot(figures, model.config.segment_length, Path(args.out), f"{name}: attention mass along {len(tokens)} tokens")
    print(f"wrote {args.out} ({len(figures)} segments, {len(figures[0])} layers)")
    if args.json:
        Path(args.json).write_text(json.dumps({"regions": REGIONS, "segments": figures}, indent=1))
    return figures


if __name__ == "__main__":
    main()
