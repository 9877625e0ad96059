"""Convert a sinkhorn-transformer `SinkhornTransformerLM` checkpoint into a `save_pretrained` folder.

    longrange convert model.pt kwargs.json out_dir [--check]

model.pt: `torch.save(model.state_dict())` of the reference model, or a checkpoint dict holding it under
`state_dict` / `model_state_dict` / `model` (an `AutoregressiveWrapper`'s state dict works too). kwargs.json: the
keyword arguments the reference `SinkhornTransformerLM` was built with (a JSON object; inline JSON is accepted
too). The folder then loads with `AutoModelForCausalLM.from_pretrained(out_dir)` (causal models) or
`AutoModelForMaskedLM` (non-causal). `--check` (needs the sinkhorn-transformer package) rebuilds the reference
model, runs both on random tokens in eval mode and prints the largest logit difference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from longrange.commands import command_parser
from longrange.convert_sinkhorn import convert, known_differences


def load_kwargs(text: str) -> dict:
    path = Path(text)
    raw = path.read_text() if path.exists() else text
    try:
        kwargs = json.loads(raw)
    except json.JSONDecodeError as error:
        raise SystemExit(f"kwargs: neither a JSON file nor inline JSON ({error})") from error
    if not isinstance(kwargs, dict):
        raise SystemExit("kwargs: expected a JSON object of SinkhornTransformerLM keyword arguments")
    if "pkm_layers" in kwargs:
        kwargs["pkm_layers"] = tuple(kwargs["pkm_layers"])
    return kwargs


def check_against_reference(checkpoint, kwargs: dict, model, length: int | None = None) -> float:
    """Largest |logit difference| between the reference package and the converted model on random tokens."""
    from sinkhorn_transformer import SinkhornTransformerLM

    from longrange.convert_sinkhorn import _unwrap

    reference = SinkhornTransformerLM(**kwargs).eval()
    reference.load_state_dict(_unwrap(checkpoint))
    length = length or model.config.max_position_embeddings
    ids = torch.randint(0, model.config.vocab_size, (2, length))
    with torch.no_grad():
        return (reference(ids) - model(ids).logits).abs().max().item()


def main(argv=None) -> None:
    parser = command_parser("convert", __doc__)
    parser.add_argument("checkpoint", help="torch.save'd state dict or checkpoint dict of the reference model")
    parser.add_argument("kwargs", help="JSON file (or inline JSON) of the SinkhornTransformerLM keyword arguments")
    parser.add_argument("output", help="folder to write (save_pretrained)")
    parser.add_argument("--check", action="store_true", help="compare logits with the reference package")
    args = parser.parse_args(argv)

    kwargs = load_kwargs(args.kwargs)
    checkpoint = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
    try:
        model = convert(checkpoint, kwargs)
    except ValueError as error:
        raise SystemExit(f"longrange convert: {error}") from error
    model.save_pretrained(args.output)
    print(f"wrote {type(model).__name__} to {args.output}")
    for line in known_differences(kwargs):
        print(f"note: {line}", file=sys.stderr)
    if args.check:
        print(
            f"max |logit difference| vs sinkhorn-transformer: {check_against_reference(checkpoint, kwargs, model):.3g}"
        )


if __name__ == "__main__":
    main()
