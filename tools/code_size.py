#!/usr/bin/env python
"""Sizes of the code in a package folder: the longest function, the longest class, the largest module and the
functions over 80 lines, read from the syntax tree.

    python tools/code_size.py                      # longrange/
    python tools/code_size.py some/package --json  # the same as JSON
    python tools/code_size.py --max-function 150 --max-class 600 --max-module 1500   # exit 1 when exceeded

Every `*.py` file under the folder (recursively) counts. A function (`def` or `async def`: methods and nested
functions included, each counted on its own) or a class spans `end_lineno - lineno + 1` lines: from its `def` /
`class` line (decorators not counted) to its last line, comments and blank lines inside included. A module's size
is its number of lines. Names are `path/in/folder.py:Qualified.name`.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LONG_FUNCTION = 80  # functions longer than this are listed


@dataclass(frozen=True)
class Item:
    name: str  # path/in/folder.py or path/in/folder.py:Qualified.name
    lines: int
    line: int  # where it starts (1 for modules)


def _walk(node: ast.AST, prefix: str, functions: list, classes: list, where: str) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            qualified = f"{prefix}{child.name}"
            item = Item(f"{where}:{qualified}", child.end_lineno - child.lineno + 1, child.lineno)
            (classes if isinstance(child, ast.ClassDef) else functions).append(item)
            _walk(child, f"{qualified}.", functions, classes, where)
        else:
            _walk(child, prefix, functions, classes, where)  # defs inside if/try/with blocks keep the outer prefix


def measure(folder: Path) -> dict:
    """{modules, functions, classes: lists of Item}, every list sorted longest first (then by name)."""
    modules, functions, classes = [], [], []
    for path in sorted(folder.rglob("*.py")):
        where = path.relative_to(folder).as_posix()
        source = path.read_text(encoding="utf-8")
        modules.append(Item(where, len(source.splitlines()), 1))
        _walk(ast.parse(source, filename=str(path)), "", functions, classes, where)
    order = lambda item: (-item.lines, item.name)  # noqa: E731
    return {"modules": sorted(modules, key=order), "functions": sorted(functions, key=order), "classes": sorted(classes, key=order)}  # fmt: skip


def summary(folder: Path, long_function: int = LONG_FUNCTION) -> dict:
    sizes = measure(folder)
    first = lambda items: asdict(items[0]) if items else None  # noqa: E731
    long = [asdict(f) for f in sizes["functions"] if f.lines > long_function]
    return {
        "folder": str(folder),
        "counts": {kind: len(items) for kind, items in sizes.items()},
        "longest_function": first(sizes["functions"]),
        "longest_class": first(sizes["classes"]),
        "largest_module": first(sizes["modules"]),
        "long_function_threshold": long_function,
        "functions_over_threshold": len(long),
        "long_functions": long,
    }


def render(result: dict) -> str:
    counts = result["counts"]
    lines = [
        f"{result['folder']}: {counts['modules']} modules, {counts['classes']} classes, {counts['functions']} functions"
    ]
    for label, key in (("longest function", "longest_function"), ("longest class", "longest_class"), ("largest module", "largest_module")):  # fmt: skip
        item = result[key]
        lines.append(f"{label:17s} " + (f"{item['lines']:5d} lines  {item['name']}" if item else "    -"))
    lines.append(f"functions over {result['long_function_threshold']} lines: {result['functions_over_threshold']}")
    lines += [f"  {f['lines']:5d}  {f['name']} (line {f['line']})" for f in result["long_functions"]]
    return "\n".join(lines)


def exceeded(result: dict, limits: dict[str, int | None]) -> list[str]:
    """One message per limit the folder exceeds."""
    messages = []
    for key, limit in limits.items():
        item = result[key]
        if limit is not None and item is not None and item["lines"] > limit:
            messages.append(f"{key.replace('_', ' ')} {item['name']}: {item['lines']} lines > {limit}")
    return messages


def shown(folder: Path) -> str:
    """The folder as the user would type it: relative to the working directory when inside it."""
    try:
        return folder.resolve().relative_to(Path.cwd().resolve()).as_posix() + "/"
    except ValueError:
        return str(folder)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", nargs="?", type=Path, default=REPO / "longrange", help="package folder (default: longrange/)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--max-function", type=int, default=None, help="exit 1 if a function is longer")
    parser.add_argument("--max-class", type=int, default=None, help="exit 1 if a class is longer")
    parser.add_argument("--max-module", type=int, default=None, help="exit 1 if a module has more lines")
    parser.add_argument(
        "--long-function", type=int, default=LONG_FUNCTION, help="list functions longer than this (default %(default)s)"
    )
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        parser.error(f"{args.folder} is not a folder")
    result = summary(args.folder, args.long_function)
    result["folder"] = shown(args.folder)
    limits = {"longest_function": args.max_function, "longest_class": args.max_class, "largest_module": args.max_module}
    problems = exceeded(result, limits)
    if args.json:
        print(json.dumps({**result, "exceeded": problems}, indent=1))
    else:
        print(render(result))
        for message in problems:
            print(f"exceeded: {message}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
