"""The `longrange` command: one subcommand per task a user runs, installed with the package.

    longrange train | finetune | evaluate | generate | visualize | convert | push  [options]   (--help on each)
    python -m longrange ...                                                        (the same, without the script)

Each subcommand is a module of this package with a `main(argv)`; only the one asked for is imported. The modeling
files never import this package (a saved folder carries the modeling code alone).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one line for `longrange --help`)
COMMANDS = {
    "train": ("train", "train a Compressive or Sinkhorn model with Accelerate (default: the stdlib sources)"),
    "finetune": ("finetune", "fine-tune a saved model with transformers.Trainer"),
    "evaluate": ("evaluate", "perplexity and bits per byte / char of a saved model over long files"),
    "generate": ("generate", "generate text from a saved folder or Hub id, streamed"),
    "visualize": ("visualize", "draw a model's attention on its memories or its Sinkhorn routing"),
    "convert": ("convert", "turn a sinkhorn-transformer checkpoint into a save_pretrained folder"),
    "push": ("push", "prepare a saved folder for the Hugging Face Hub and upload it"),
}


def command_parser(name: str, doc: str, first_paragraph_only: bool = False) -> argparse.ArgumentParser:
    """The argument parser of `longrange NAME`, with the module's docstring as its description."""
    description = doc.split("\n\n")[0] if first_paragraph_only else doc
    return argparse.ArgumentParser(
        prog=f"longrange {name}", description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = [f"  {name.ljust(width)}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return (
        "usage: longrange COMMAND [options]\n\nCompressive and Sinkhorn Transformers for Hugging Face transformers."
        "\n\ncommands:\n" + "\n".join(lines) + "\n\n`longrange COMMAND --help` lists a command's options.\n"
    )


def main(argv: list[str] | None = None) -> int:
    """Run `longrange COMMAND ...`: the command's `main` with the remaining arguments."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), end="", file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"longrange: unknown command {name!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"{__name__}.{COMMANDS[name][0]}")
    module.main(rest)
    return 0
