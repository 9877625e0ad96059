"""Draw where a saved Compressive model looks: the attention mass each layer gives to its compressed memory, its
memory and the current segment, along a long document read through the model's cache.

    python scripts/visualize.py outputs/compressive-stdlib/model --text_file some_long_file.txt --out attention.png

The document is fed one segment at a time with the cache carried across (as generation and streaming evaluation
do), with `output_attentions=True`; each point is one segment: the mass of each region averaged over the
segment's tokens and the layer's heads. Writes the PNG and, with --json, the numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import longrange  # noqa: F401  registers the longrange model types with the Auto classes
from longrange.tokenization import encode_bytes, is_byte_tokenizer

REGIONS = ("compressed memory", "memory", "segment")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("model", help="saved Compressive model folder (save_pretrained) with its tokenizer")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--text_file", help="a long text file to read")
    source.add_argument("--text", help="the text itself")
    p.add_argument("--max_tokens", type=int, default=8192, help="read at most this many tokens (default 8192)")
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
    args = parse_args(argv)
    model = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=args.trust_remote_code).eval()
    if model.config.model_type != "compressive":
        sys.exit(f"visualize.py draws Compressive models; {args.model} is a {model.config.model_type!r} model")
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    text = Path(args.text_file).read_text(encoding="utf-8", errors="replace") if args.text_file else args.text
    if is_byte_tokenizer(tokenizer):
        tokens = encode_bytes(tokenizer, text.encode("utf-8"))
    else:
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
    tokens = tokens[: args.max_tokens]
    if len(tokens) < 2:
        sys.exit("the text is too short: at least 2 tokens are needed")
    figures = attention_mass(model, torch.tensor([tokens]))
    folder = Path(args.model)
    name = folder.parent.name if folder.name == "model" and folder.parent.name else folder.name or str(folder)
    plot(figures, model.config.segment_length, Path(args.out), f"{name}: attention mass along {len(tokens)} tokens")
    print(f"wrote {args.out} ({len(figures)} segments, {len(figures[0])} layers)")
    if args.json:
        Path(args.json).write_text(json.dumps({"regions": REGIONS, "segments": figures}, indent=1))
    return figures


if __name__ == "__main__":
    main()
