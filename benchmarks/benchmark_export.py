"""Exported decoding steps, batch 1, on the CPU: the same one-token step eager, as a `torch.export` program and in
onnxruntime, for both models and transformers' Llama (its static-cache step from transformers' own recipe).

    python benchmarks/benchmark_export.py                  # hidden 512 x 6 layers, after a 1,024-token prompt
    python benchmarks/benchmark_export.py --quick          # tiny smoke run (CI)
    python benchmarks/benchmark_export.py --json /tmp/export.json --threads 1

Models: `benchmark_decoding.py`'s (hidden 512, 6 layers, 8 heads; Compressive segments of 512, Sinkhorn buckets of
128), fp32. Rows, each a step after a random prompt of `context` tokens:
- `eager`: the step in PyTorch. Ours: `ExportableDecoder`'s forward, the static cache path that `generate()` and
  the exported program take. Llama: `TorchExportableModuleWithStaticCache` (its StaticCache), called directly.
- `exported`: `torch.export` of that step (`ExportableDecoder.export()`, transformers' recipe), `.module()` called.
- `onnxruntime`: the step with its state passed in and out (`ExportableDecoder.export_onnx`; Llama's through the
  same `StatePassingStep`), run by onnxruntime, each call's state outputs fed to the next.
Each row: the median of `--steps` calls after 3 warm-up calls, the token fixed (the time does not depend on it); the
three modes of a model interleaved over `--rounds` rounds. Also recorded: the export time and the state's size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark_decoding as decoding  # noqa: E402  (the models of the decoding benchmark)

FAMILIES = ("compressive", "sinkhorn", "llama")
MODES = ("eager", "exported", "onnxruntime")


def steps_of(family: str, size: dict, context: int, calls: int, folder: Path) -> dict:
    """Per mode a function running one step (a fixed token), the export time and the state's megabytes. Ours
    advance their cache at every call (eager and exported share it): it holds `calls` steps after the prompt."""
    import onnxruntime

    from longrange.export import ExportableDecoder, StatePassingStep

    model = decoding.build(decoding.Row(family, "llama" if family == "llama" else "ours", "eager", context), size)
    prompt = decoding.random_prompt(context)
    token, path = prompt[:, -1:], str(folder / f"{family}.onnx")
    start = time.perf_counter()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if family == "llama":
            from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

            model.generation_config.cache_implementation = "static"
            recipe = TorchExportableModuleForDecoderOnlyLM(model, 1, context + 1, "cpu")
            position = torch.tensor([context])  # (every call writes the same slot: the time is the same)
            llama_step = recipe.model  # (keyword arguments only: its second positional one is embeddings)
            eager = lambda *inputs: llama_step(input_ids=inputs[0], cache_position=inputs[1])  # noqa: E731
            state = [t for layer in recipe.model.static_cache.layers for t in (layer.keys, layer.values)]
            inputs, names = (token, position), [f"past.{i}" for i in range(len(state))]
            program = recipe.export(input_ids=token, cache_position=position, strict=False).module()
            exported = lambda: program(input_ids=token, cache_position=position)  # noqa: E731
            passing = StatePassingStep(llama_step, state, input_names=("input_ids", "cache_position"))
            step_program = torch.export.export(passing, (*inputs, *state), strict=True)
            feed = {"input_ids": token.numpy(), "cache_position": position.numpy()}
            torch.onnx.export(
                step_program, dynamo=True, verbose=False, input_names=["input_ids", "cache_position", *names],
                output_names=["logits", *(n.replace("past", "present") for n in names)],
            ).save(path)  # fmt: skip
            values = {name: t.numpy().copy() for name, t in zip(names, state)}
        else:
            eager = ExportableDecoder(model, prompt, max_new_tokens=calls)
            inputs, program = (token,), eager.export().module()
            exported = lambda: program(token)  # noqa: E731
            eager.export_onnx(path)
            feed, values = {"input_ids": token.numpy()}, {k: v.numpy() for k, v in eager.state().items()}
    export_s = time.perf_counter() - start
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])

    def run_onnx():
        nonlocal values
        _, *new = session.run(None, {**feed, **values})
        values = dict(zip(values, new))

    return dict(
        steps=dict(eager=lambda: eager(*inputs), exported=exported, onnxruntime=run_onnx),
        export_s=export_s,
        state_mb=sum(v.nbytes for v in values.values()) / 1e6,
    )


def measure(family: str, size: dict, context: int, steps: int, rounds: int, folder: Path) -> dict:
    made = steps_of(family, size, context, size["new_tokens"], folder)
    times = {mode: [] for mode in MODES}
    with torch.no_grad():
        for _ in range(rounds):
            for mode in MODES:
                step = made["steps"][mode]
                for _ in range(3):
                    step()
                for _ in range(steps):
                    start = time.perf_counter()
                    step()
                    times[mode].append(time.perf_counter() - start)
    row = {f"{mode}_ms": 1e3 * statistics.median(times[mode]) for mode in MODES}
    row.update(export_s=made["export_s"], state_mb=made["state_mb"])
    row["onnxruntime_vs_eager"] = row["eager_ms"] / row["onnxruntime_ms"]
    return row


def table(rows: dict) -> str:
    lines = [
        "| model | eager ms | exported ms | onnxruntime ms | onnxruntime speed vs eager | export s | state MB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for family, r in rows.items():
        lines.append(
            f"| {family} | {r['eager_ms']:.2f} | {r['exported_ms']:.2f} | {r['onnxruntime_ms']:.2f} | "
            f"{r['onnxruntime_vs_eager']:.2f}x | {r['export_s']:.1f} | {r['state_mb']:.1f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models and context (a smoke run)")
    parser.add_argument("--context", type=int, default=None, help="prompt tokens (default 1,024; quick: 64)")
    parser.add_argument("--steps", type=int, default=None, help="timed calls per mode and round (default 20)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three modes, interleaved")
    parser.add_argument("--threads", type=int, default=1, help="torch and onnxruntime threads")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    size = decoding.sizes(args.quick)
    context = args.context or (64 if args.quick else 1024)
    steps, rounds = args.steps or (2 if args.quick else 20), 1 if args.quick else args.rounds
    size["contexts"], size["new_tokens"] = [context], len(MODES) * rounds * (3 + steps)  # every call a new token
    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        for family in args.families:
            print(f"{family}: exporting and timing ...", file=sys.stderr, flush=True)
            rows[family] = measure(family, size, context, steps, rounds, Path(folder))
    result = dict(context=context, width=size["width"], threads=args.threads, steps=steps, rounds=rounds, rows=rows)
    result["versions"] = {"torch": torch.__version__, "onnxruntime": __import__("onnxruntime").__version__}
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
