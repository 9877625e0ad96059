"""Upload a saved longrange model folder to the Hugging Face Hub.

    longrange push runs/compressive your-name/compressive-shakespeare --dry_run --out upload/

The upload folder is prepared first (`longrange.hub.prepare_hub_folder`): the model is loaded and saved again, so it
holds safetensors weights, `config.json` with `auto_map`, the modeling code (so `trust_remote_code=True` works
without our package), the tokenizer and a model card (the folder's README.md, or one written from `--dataset` /
`--metrics_json`). `--dry_run` stops there and lists the files; without it the folder is uploaded with
`huggingface_hub` (log in first with `hf auth login` or pass `--token`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from longrange.commands import command_parser
from longrange.hub import prepare_hub_folder, push_folder


def parse_args(argv=None) -> argparse.Namespace:
    p = command_parser("push", __doc__, first_paragraph_only=True)
    p.add_argument("folder", help="a folder written by save_pretrained (model + tokenizer)")
    p.add_argument("repo_id", help="Hub repository, e.g. your-name/compressive-shakespeare")
    p.add_argument("--dry_run", action="store_true", help="prepare the upload folder and list it; upload nothing")
    p.add_argument("--out", default=None, help="where to prepare the upload folder (default: a temporary folder)")
    p.add_argument("--dataset", default=None, help="model card: one sentence on the training data")
    p.add_argument("--metrics_json", default=None, help="model card: a JSON file of metric name -> value")
    p.add_argument("--private", action="store_true")
    p.add_argument("--token", default=None, help="Hub token (default: the saved login)")
    p.add_argument("--trust_remote_code", action="store_true", help="load a folder whose classes longrange lacks")
    return p.parse_args(argv)


def main(argv=None) -> Path:
    args = parse_args(argv)
    if "/" not in args.repo_id.strip("/") or args.repo_id.count("/") > 1:
        raise SystemExit(f"error: repo_id must look like 'owner/name', got {args.repo_id!r}")
    folder = Path(args.folder)
    if not (folder / "config.json").is_file():
        raise SystemExit(f"error: {folder} is not a saved model folder (no config.json)")
    card = None
    if args.dataset or args.metrics_json:
        metrics = json.loads(Path(args.metrics_json).read_text()) if args.metrics_json else None
        if metrics is not None:
            metrics = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        card = {"dataset": args.dataset, "metrics": metrics}
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="longrange-upload-"))
    prepare_hub_folder(folder, out, trust_remote_code=args.trust_remote_code, card=card, repo_id=args.repo_id)
    print(f"upload folder for {args.repo_id}: {out}")
    for path in sorted(out.rglob("*")):
        if path.is_file():
            print(f"  {path.relative_to(out)}  ({path.stat().st_size:,} bytes)")
    if args.dry_run:
        print("dry run: nothing uploaded")
        return out
    url = push_folder(out, args.repo_id, private=args.private, token=args.token)
    print(f"uploaded: {url}")
    return out


if __name__ == "__main__":
    main()
