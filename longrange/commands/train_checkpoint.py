"""The checkpoints of `longrange train`: what a run writes under `<output_dir>/checkpoints/step_<n>` and how a run
resumes from them, with the same spread of the global batch over processes, accumulation steps and rows or another.
`longrange.commands.train_run` holds the run that saves and loads them."""

from __future__ import annotations

from pathlib import Path

import torch


def check_layout(saved: dict | None, current: dict, carry: bool, say) -> None:
    """Whether a run laid out as `current` may resume a checkpoint saved with the layout `saved` (None: a checkpoint
    from before layouts were recorded, taken as the same). The data of a step is a function of the step, the global
    batch and the window only, so with the same two the run continues exactly (to the order of float sums and, with
    dropout and other processes, the random draws); with others the stream's lanes and windows are cut elsewhere,
    which a run that carries memories cannot follow."""
    if saved is None or all(saved[key] == current[key] for key in ("global_batch", "window")):
        return

    def described(layout: dict) -> str:
        spread = (
            f"{layout['processes']} processes x {layout['accumulation']} accumulation steps x {layout['rows']} rows"
        )
        return f"{layout['global_batch']} rows ({spread}) of {layout['window']} tokens"

    was, now = described(saved), described(current)
    if carry:
        raise SystemExit(
            f"--resume_from: the checkpoint carries memories for a global batch of {was}, this run's is {now}: pass "
            f"--window {saved['window']} and --batch_size and --gradient_accumulation_steps whose product with the "
            f"{current['processes']} processes is {saved['global_batch']}, or --no-carry_cache to start the memories "
            "afresh"
        )
    say(f"resuming with a global batch of {now} instead of {was}: the data from here on differs from the saved run's")


def carried_memories(folder: Path, layout, rank: int, device) -> list:
    """This process's carried memories, one per accumulation micro-step (None: its lanes start afresh), rebuilt from
    what every process of the saving run wrote: each file lists the stream lanes its memories' rows continue, so
    the rows regroup for any number of processes and accumulation steps with the same global batch."""
    from longrange.cache_compressive import CompressiveMemoryCache, cache_of_rows

    held = {}  # lane -> (cache, row)
    for file in sorted(folder.glob("stream_cache_rank*.pt")):
        saved = torch.load(file, map_location="cpu", weights_only=False)
        if isinstance(saved, list):  # older checkpoints: the saving rank's caches, for the same layout as this run
            saving_rank = int(file.stem.removeprefix("stream_cache_rank"))
            lanes = [range(layout.global_batch)[layout.rows_of(saving_rank, micro)] for micro in range(len(saved))]
            saved = {"lanes": lanes, "caches": [None if c is None else c.state_dict() for c in saved]}
        for lanes, state in zip(saved["lanes"], saved["caches"]):
            if state is not None:
                cache = CompressiveMemoryCache.from_state_dict(state)  # (on the CPU until regrouped)
                held.update({lane: (cache, row) for row, lane in enumerate(lanes)})
    caches = []
    for micro in range(layout.accumulation):
        lanes = range(layout.global_batch)[layout.rows_of(rank, micro)]
        missing = [lane for lane in lanes if lane not in held]
        if held and missing:
            raise SystemExit(f"--resume_from: {folder} holds no carried memory for lanes {missing} of the stream")
        caches.append(cache_of_rows([held[lane] for lane in lanes], device) if held else None)
    return caches


class Checkpoints:
    """One run's checkpoints: what `accelerator.save_state` writes (model, optimizer, scheduler, the `TrainState`
    with the run's layout, every process's RNG states) and, when the run carries memories, each process's memories
    with the stream lanes their rows continue.

    layout: how the run spreads its global batch ({processes, accumulation, rows, global_batch, window}); lanes: the
    batcher's map from (rank, micro-step) to rows of the global batch; carry: whether the run carries memories.
    """

    def __init__(self, accelerator, output_dir: Path, layout: dict[str, int], lanes, carry: bool):
        self.accelerator, self.output_dir = accelerator, output_dir
        self.layout, self.lanes, self.carry = layout, lanes, carry

    def save(self, state, caches: list) -> None:
        """`<output_dir>/checkpoints/step_<state.step>`, written by every process (`caches`: this process's)."""
        folder = self.output_dir / "checkpoints" / f"step_{state.step}"
        state.layout = self.layout
        self.accelerator.save_state(str(folder))  # model, optimizer, scheduler, TrainState, every process's RNG
        if self.carry:  # each process's memories, with the stream lanes their rows continue
            lanes, rank = self.lanes, self.accelerator.process_index
            rows = [list(range(lanes.global_batch)[lanes.rows_of(rank, micro)]) for micro in range(len(caches))]
            saved = [None if cache is None else cache.state_dict() for cache in caches]
            torch.save({"lanes": rows, "caches": saved}, folder / f"stream_cache_rank{rank}.pt")
        self.accelerator.wait_for_everyone()

    def load(self, folder: Path, state) -> list | None:
        """Loads `folder` into the prepared objects and `state`; this process's carried memories (None when the run
        carries none). The number of processes, accumulation steps and rows per micro-step may differ from the run
        that saved the checkpoint (see `check_layout`)."""
        self.accelerator.load_state(str(folder))
        saved, state.layout = state.layout, self.layout
        check_layout(saved, self.layout, self.carry, self.accelerator.print)
        if not self.carry:
            return None
        return carried_memories(folder, self.lanes, self.accelerator.process_index, self.accelerator.device)
