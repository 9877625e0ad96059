"""Generate text from any saved model folder or Hub id, streaming tokens to the terminal as they come.

    longrange generate runs/compressive --prompt "ROMEO:" --max_new_tokens 200 --do_sample --top_k 40

The model and tokenizer load through the Auto classes (`AutoModelForCausalLM`, `AutoTokenizer`), so this works for
longrange folders (with the package installed, or with `--trust_remote_code` from the code saved in the folder) and
for any other causal LM. Tokens are printed by `transformers.TextStreamer` while decoding; beam search
(`--num_beams` > 1) prints the finished text instead, since beams are only final at the end.

Fastest on a GPU: `--device cuda --dtype bfloat16` (the default `--compile auto` lets `generate()` compile the
decoding step and capture it in CUDA graphs, as it does for any model whose cache is compileable, ours included).
`--compile always` compiles on every device (on the CPU too: there eager and compiled steps are about as fast);
`--compile never` keeps every step eager.
"""

from __future__ import annotations

import argparse
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TextStreamer, set_seed

import longrange  # noqa: F401  registers the longrange model types with the Auto classes
from longrange.commands import command_parser
from longrange.hub import check_model_source

DTYPES = ("auto", "float32", "bfloat16", "float16")


def compile_options(mode: str) -> dict:
    """generate() keyword arguments for `--compile`: nothing (transformers' own rule), a compile config that also
    applies off CUDA, or no compilation."""
    if mode == "never":
        return {"disable_compile": True}
    if mode == "always":
        from transformers import CompileConfig

        config = CompileConfig(fullgraph=True)
        config._compile_all_devices = True  # transformers' switch for compiling off CUDA
        return {"compile_config": config}
    return {}


def parse_args(argv=None) -> argparse.Namespace:
    p = command_parser("generate", __doc__, first_paragraph_only=True)
    p.add_argument("model", help="saved model folder (save_pretrained) or Hub id")
    p.add_argument("--prompt", default="", help="text to continue (empty: start from the tokenizer's bos token)")
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--do_sample", action="store_true", help="sample instead of greedy / beam search")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top_k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--num_beams", type=int, default=1)
    p.add_argument("--num_return_sequences", type=int, default=1)
    p.add_argument("--repetition_penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no_stream", action="store_true", help="print only the finished text")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="weights' dtype: auto (as saved), float32, bfloat16 (fastest on GPUs), float16",
    )
    p.add_argument(
        "--compile",
        default="auto",
        choices=("auto", "always", "never"),
        help="compile the decoding step: auto (generate() decides: on CUDA when the cache is compileable), always "
        "(every device), never",
    )
    p.add_argument("--trust_remote_code", action="store_true", help="run the modeling code saved with the model")
    args = p.parse_args(argv)
    checks = [
        (args.max_new_tokens >= 1, f"--max_new_tokens must be at least 1, got {args.max_new_tokens}"),
        (args.temperature > 0, f"--temperature must be positive, got {args.temperature}"),
        (args.top_k >= 0, f"--top_k must be 0 (off) or positive, got {args.top_k}"),
        (0 < args.top_p <= 1, f"--top_p must be in (0, 1], got {args.top_p}"),
        (args.num_beams >= 1, f"--num_beams must be at least 1, got {args.num_beams}"),
        (
            1 <= args.num_return_sequences and (args.do_sample or args.num_return_sequences <= args.num_beams),
            "--num_return_sequences must be at least 1 and, without --do_sample, at most --num_beams",
        ),
    ]
    for ok, message in checks:
        if not ok:
            p.error(message)
    return args


def main(argv=None) -> list[str]:
    args = parse_args(argv)
    set_seed(args.seed)
    check_model_source(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=args.trust_remote_code, dtype=dtype)
    model.to(args.device).eval()

    if args.prompt:
        input_ids = tokenizer(args.prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    elif tokenizer.bos_token_id is not None:
        input_ids = torch.tensor([[tokenizer.bos_token_id]])
    else:
        raise SystemExit("error: --prompt is empty and the tokenizer has no bos token to start from")
    stream = not args.no_stream and args.num_beams == 1 and args.num_return_sequences == 1
    # the streamer prints the prompt first, then each new piece of text as soon as it decodes to whole characters
    streamer = TextStreamer(tokenizer, skip_special_tokens=True) if stream else None

    sampling = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p} if args.do_sample else {}
    output = model.generate(
        input_ids.to(args.device),
        attention_mask=torch.ones_like(input_ids).to(args.device),
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        num_beams=args.num_beams,
        num_return_sequences=args.num_return_sequences,
        repetition_penalty=args.repetition_penalty,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        streamer=streamer,
        **sampling,
        **compile_options(args.compile),
    )
    texts = tokenizer.batch_decode(output, skip_special_tokens=True)
    if streamer is None:
        for i, text in enumerate(texts):
            if len(texts) > 1:
                print(f"--- sequence {i + 1} ---")
            print(text)
    return texts


if __name__ == "__main__":
    main()
    sys.exit(0)
