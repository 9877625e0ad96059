"""`transformers.Trainer` subclasses for longrange models.

- `LongrangeTrainer`: Trainer with the Compressive loss parts (`lm_loss`, `reconstruction_loss`) weighted correctly
  under gradient accumulation and several processes, logged beside `loss`, and the longrange model card.
- `MemoryTrainer`: the same, with the Compressive memory carried from batch to batch (Transformer-XL training, what
  `TrainingArguments.past_index` did for `mems` before transformers v5 removed it). Its datasets are `StreamWindows`:
  each row of a batch continues, window after window, one contiguous lane of the token stream, exactly as
  `longrange train --streaming` lays batches out (`longrange.data.StreamBatcher`).

The rules MemoryTrainer follows:

- Lanes. A stream is cut into `processes x accumulation steps x per-device batch` lanes (rank-major, then micro-step,
  then row: `longrange.data._Layout`). Rank r's micro-step m always holds the same lanes, so one process with
  accumulation 2 computes what two processes compute side by side. Every batch is full: the stream's tail that does
  not fill one more window in every lane is dropped (the "smaller last batch" never happens).
- Sharding. Trainer's dataloader goes through `accelerator.prepare`, which deals whole batches to the processes in
  turn (`BatchSamplerShard`, `split_batches=False`); the dataset is ordered so that each process receives its own
  lanes in order. Every batch is checked against this (a process that gets another's lanes raises).
- Memory. One memory per lane group (= per micro-step), detached, continued only if the batch is the window right
  after the one the memory has seen; a lane group at window 0 (first step, or a new epoch) starts empty.
- Evaluation. Memory starts empty at the start of every evaluation and is carried across the evaluation stream,
  laid out in `processes x per_device_eval_batch_size` lanes; the training memories are left untouched and
  training continues with them afterwards.
- Checkpoints. Each process writes its memories to `stream_memory_rank<r>.pt` in the checkpoint folder; resuming
  (`train(resume_from_checkpoint=...)`) restores them, so training continues exactly as without the interruption,
  also with another number of processes, accumulation steps or rows per device that keeps the global batch (each
  process regroups the saved rows of its lanes).
  A checkpoint without those files (written by another trainer) or with another lane layout (another global batch
  or window) resumes with empty memories from the resumed window on: the memory rebuilds itself as the lanes
  stream on (a warning says so).
"""

from __future__ import annotations

import glob
import logging
import os
import re
from dataclasses import dataclass

import numpy as np
import torch
import transformers
from packaging.version import Version
from torch.utils.data import Dataset, SequentialSampler
from transformers import Trainer
from transformers.trainer_utils import get_last_checkpoint

from .cache_compressive import CompressiveMemoryCache, cache_of_rows
from .compat import TRAINER_COUNTS_PREDICTED_LABELS
from .data import StreamBatcher
from .training import carries_cache

# versions on which MemoryTrainer was checked against the plain streaming loop (tests/test_memory_trainer.py): 5.17
# and 5.24 equal it; 5.5 does not after a mid-training evaluation under gradient accumulation (not bisected further)
MEMORY_TRAINER_MIN_TRANSFORMERS = (5, 17)
MEMORY_TRAINER_SUPPORTED = Version(transformers.__version__).release >= MEMORY_TRAINER_MIN_TRANSFORMERS

logger = logging.getLogger(__name__)

MEMORY_FILE = "stream_memory_rank{rank}.pt"
STREAM_COLUMNS = ("stream_lane", "stream_position")


class LongrangeTrainer(Trainer):
    """A Trainer that also logs the auxiliary losses a model reports (`lm_loss`, `reconstruction_loss`).

    Trainer optimises and logs `outputs.loss` only (for the Compressive model: LM loss + reconstruction loss, which
    the model weights for Trainer's accumulation and processes itself). This subclass collects the two parts per
    step and adds their means to the train and eval logs. It also keeps only the logits for `compute_metrics` (the
    cache and the loss parts are not predictions; an answer head's start and end logits), and writes the longrange
    model card when pushing.
    """

    def __init__(self, *args, card: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        # per phase: name -> [running sum, count] since the last log (sums, not lists: with logging off, a list
        # would keep two tensors per step for the whole run)
        self._aux: dict[str, dict[str, list]] = {"train": {}, "eval": {}}
        self.card = dict(card or {})

    def run_model(self, model, inputs: dict, **loss_kwargs):
        """The forward call of `compute_loss` (MemoryTrainer adds the carried memory here)."""
        return model(**inputs, **loss_kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # Trainer's rule, written out: with `num_items_in_batch` the model divides its losses by the tokens of the
        # whole accumulated batch over all processes (the Compressive model weights its reconstruction loss by the
        # call's share of them), so Trainer neither divides the loss by the accumulation steps nor lets the
        # gradient average over processes shrink it (it multiplies the loss by the number of processes).
        normalised = self.model_accepts_loss_kwargs and num_items_in_batch is not None
        outputs = self.run_model(model, inputs, **({"num_items_in_batch": num_items_in_batch} if normalised else {}))
        lm_loss = getattr(outputs, "lm_loss", None)
        processes = self.accelerator.num_processes if normalised and self.args.average_tokens_across_devices else 1
        loss = outputs.loss * processes
        phase = "train" if model.training else "eval"
        if lm_loss is not None:
            if normalised:  # back to the mean over this call's predicted tokens, for the log
                predicted = inputs["labels"][..., 1:].ne(-100).sum()
                lm_loss = lm_loss * num_items_in_batch / predicted.clamp_min(1)
            self._add_aux(phase, "lm_loss", lm_loss)
        reconstruction = getattr(outputs, "reconstruction_loss", None)
        if reconstruction is not None:
            self._add_aux(phase, "reconstruction_loss", reconstruction)
        predictions = {name: value for name, value in outputs.items() if name.endswith("logits")}  # answer heads: 2
        return (loss, predictions) if return_outputs else loss

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        # the divisor of the summed LM loss: the predicted tokens, `labels[..., 1:]` (transformers < 5.10.1 counted
        # every label, one per row too many; later versions count these, and this changes nothing there)
        if not TRAINER_COUNTS_PREDICTED_LABELS:
            batch_samples = [
                {**batch, "labels": batch["labels"][..., 1:]} if "labels" in batch else batch for batch in batch_samples
            ]
        return super()._get_num_items_in_batch(batch_samples, device)

    def _add_aux(self, phase: str, name: str, value: torch.Tensor) -> None:
        value = value.detach().float()
        entry = self._aux[phase].get(name)
        if entry is None:
            self._aux[phase][name] = [value, 1]
        else:
            entry[0], entry[1] = entry[0] + value, entry[1] + 1

    def _aux_means(self, phase: str) -> dict[str, float]:
        means = {}
        for name, (total, count) in self._aux[phase].items():
            mean = total / count
            means[name] = float(self.accelerator.reduce(mean, reduction="mean"))  # average over processes
        self._aux[phase].clear()
        return means

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training log: the parts since the previous one
            logs.update(self._aux_means("train"))
        if "eval_loss" in logs:
            logs.update({f"eval_{name}": value for name, value in self._aux_means("eval").items()})
        super().log(logs, start_time)

    def create_model_card(self, **kwargs):
        from .hub import write_model_card

        if not self.is_world_process_zero():
            return
        # the latest evaluation; speed figures describe this machine, not the model
        metrics = {
            k: v
            for entry in self.state.log_history
            for k, v in entry.items()
            if k.startswith("eval_") and "runtime" not in k and "per_second" not in k
        }
        write_model_card(
            self.args.output_dir,
            model=self.accelerator.unwrap_model(self.model),
            tokenizer=self.processing_class,
            metrics=metrics or None,
            repo_id=self.args.hub_model_id,
            **self.card,
        )


# ----------------------------------------------------------------------------------------------------------------
# Streams of windows
# ----------------------------------------------------------------------------------------------------------------


class StreamWindows(Dataset):
    """A token stream read in windows, for `MemoryTrainer`: every item is one window of one lane.

    `StreamWindows(ids, window)` is the stream; MemoryTrainer lays it out for its batch size, processes and
    accumulation steps (`laid_out`), so the same object serves any run configuration. Items of a laid-out stream
    are dicts with `input_ids` and `labels` (the same window: the model shifts labels), `stream_lane` and
    `stream_position` (which lane, which window of it). Dataset index order is the order in which Trainer's
    dataloader hands whole batches to processes in turn: batch g goes to rank g % P, whose (g // P)-th batch is
    micro-step (g // P) % A of optimizer step (g // P) // A; its rows are that rank's and micro-step's lanes.
    """

    def __init__(self, ids, window: int):
        ids = np.asarray(ids)
        if ids.ndim != 1:
            raise ValueError(f"ids must be one stream of token ids (1-D), got shape {ids.shape}")
        if window < 1:
            raise ValueError(f"window must be a positive number of tokens, got {window}")
        self.ids = ids
        self.window = int(window)
        self.batcher: StreamBatcher | None = None
        self.rows = 0

    def laid_out(self, rows: int, world_size: int = 1, accumulation: int = 1) -> StreamWindows:
        """The stream cut into `world_size * accumulation * rows` lanes (see `longrange.data.StreamBatcher`)."""
        laid = StreamWindows.__new__(StreamWindows)
        laid.ids, laid.window, laid.rows = self.ids, self.window, int(rows)
        laid.batcher = StreamBatcher(self.ids, self.window, rows * world_size * accumulation, world_size, accumulation)
        return laid

    @property
    def layout(self):
        return None if self.batcher is None else self.batcher.layout

    @property
    def steps_per_epoch(self) -> int:
        self._check_laid_out()
        return self.batcher.steps_per_epoch

    def signature(self) -> dict:
        """What a saved memory must match to continue: the lane layout over the stream."""
        self._check_laid_out()
        return {
            "global_batch": self.layout.global_batch,
            "window": self.window,
            "lane_tokens": int(self.batcher.lanes.shape[1]),
        }

    def _check_laid_out(self) -> None:
        if self.batcher is None:
            raise RuntimeError("this StreamWindows is not laid out: call laid_out(rows, world_size, accumulation)")

    def __len__(self) -> int:
        if self.batcher is None:  # the stream alone: its number of whole windows
            return len(self.ids) // self.window
        return self.batcher.steps_per_epoch * self.layout.global_batch

    def __getitem__(self, index: int) -> dict:
        self._check_laid_out()
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} windows")
        layout = self.layout
        batch, row = divmod(index, self.rows)
        rank = batch % layout.world_size
        step, micro = divmod(batch // layout.world_size, layout.accumulation)
        lane = layout.rows_of(rank, micro).start + row
        window = self.batcher.lanes[lane, step * self.window : (step + 1) * self.window].clone()
        return {"input_ids": window, "labels": window, "stream_lane": lane, "stream_position": step}


@dataclass(frozen=True)
class StreamSlice:
    """Which lanes (one per row) and which window of them a batch holds. Not a tensor: it stays on the host."""

    lanes: tuple[int, ...]
    position: int


def collate_stream_windows(features: list[dict]) -> dict:
    """Stacks `StreamWindows` items into `input_ids` / `labels` [rows, window] and one `stream` (a `StreamSlice`)."""
    positions = {int(f["stream_position"]) for f in features}
    if len(positions) != 1:
        raise ValueError(f"a streaming batch must hold one window position, got {sorted(positions)}")
    return {
        "input_ids": torch.stack([torch.as_tensor(f["input_ids"]) for f in features]),
        "labels": torch.stack([torch.as_tensor(f["labels"]) for f in features]),
        "stream": StreamSlice(tuple(int(f["stream_lane"]) for f in features), positions.pop()),
    }


# ----------------------------------------------------------------------------------------------------------------
# Memories as plain tensors (checkpoint files load with weights_only=True)
# ----------------------------------------------------------------------------------------------------------------


def memory_state(cache: CompressiveMemoryCache) -> dict:
    """A `CompressiveMemoryCache` as a dict of tensors and plain values (for `torch.save`); the cache saves itself."""
    return cache.state_dict()


def memory_from_state(state: dict, device=None) -> CompressiveMemoryCache:
    """The inverse of `memory_state`, on `device`."""
    return CompressiveMemoryCache.from_state_dict(state, device)


# ----------------------------------------------------------------------------------------------------------------
# MemoryTrainer
# ----------------------------------------------------------------------------------------------------------------


class MemoryTrainer(LongrangeTrainer):
    """LongrangeTrainer that carries the Compressive memory from batch to batch (see the module docstring).

    `train_dataset` / `eval_dataset` (and `predict`'s dataset) must be `StreamWindows`; the default collator is
    `collate_stream_windows`. Use it for `CompressiveForCausalLM` (or a PEFT wrapper of it).
    """

    def __init__(self, *args, data_collator=None, **kwargs):
        if not MEMORY_TRAINER_SUPPORTED:
            raise RuntimeError(
                f"MemoryTrainer needs transformers >= {'.'.join(map(str, MEMORY_TRAINER_MIN_TRANSFORMERS))} (installed: "
                f"{transformers.__version__}): on transformers 5.5 the training step after an evaluation under gradient "
                "accumulation differs from the streaming loop; LongrangeTrainer (no memory across batches) works"
            )
        super().__init__(*args, data_collator=data_collator or collate_stream_windows, **kwargs)
        config = getattr(self.accelerator.unwrap_model(self.model), "config", None)
        if config is None or not carries_cache(config):
            kind = getattr(config, "model_type", type(self.model).__name__)
            raise ValueError(
                f"MemoryTrainer needs a model that keeps a memory (model_type 'compressive'), got {kind!r}"
            )
        if self.args.n_gpu > 1:
            raise ValueError(
                f"MemoryTrainer does not support torch.nn.DataParallel (n_gpu={self.args.n_gpu}): the memory cannot be "
                "split over replicas; launch one process per GPU (torchrun / accelerate launch) instead"
            )
        if self.args.auto_find_batch_size:
            raise ValueError("MemoryTrainer: auto_find_batch_size would change the lanes mid-run; set it to False")
        loader = self.accelerator.dataloader_config
        for name in ("split_batches", "dispatch_batches"):
            if getattr(loader, name, None):
                raise ValueError(
                    f"MemoryTrainer needs accelerator_config {name}=False (whole batches dealt to processes in turn)"
                )
        if self.args.dataloader_num_workers and not self.args.dataloader_in_order:
            raise ValueError("MemoryTrainer needs dataloader_in_order=True: windows of a lane must come in order")
        self._memories: dict[str, dict] = {"train": {}, "eval": {}}
        self._layouts: dict[str, StreamWindows] = {}
        self._resume_memory_from: str | None = None
        self._warned_rebuild = False

    # ---- data -------------------------------------------------------------------------------------------------

    def _set_signature_columns_if_needed(self) -> None:
        super()._set_signature_columns_if_needed()
        self._signature_columns += [c for c in STREAM_COLUMNS if c not in self._signature_columns]

    def _stream_loader(self, dataset, phase: str, rows: int, accumulation: int, description: str):
        if not isinstance(dataset, StreamWindows):
            raise TypeError(
                f"MemoryTrainer: the {description.lower()} dataset must be a longrange.trainer.StreamWindows, got "
                f"{type(dataset).__name__}"
            )
        try:
            laid = dataset.laid_out(rows, self.args.world_size, accumulation)
        except ValueError as err:
            batch = "per_device_train_batch_size" if phase == "train" else "per_device_eval_batch_size"
            raise ValueError(
                f"MemoryTrainer: the {description.lower()} stream is too short for its lanes ({err}); lanes = processes"
                f" x {'gradient_accumulation_steps x ' if phase == 'train' else ''}{batch}: lower {batch} or the window"
            ) from err
        self._layouts[phase] = laid
        return self._get_dataloader(
            dataset=laid,
            description=description,
            batch_size=rows,
            sampler_fn=SequentialSampler,
            is_training=phase == "train",
        )

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        loader = self._stream_loader(
            self.train_dataset, "train", self._train_batch_size, self.args.gradient_accumulation_steps, "Training"
        )
        if self._resume_memory_from is not None:
            self._load_memories(self._resume_memory_from)
            self._resume_memory_from = None
        return loader

    def get_eval_dataloader(self, eval_dataset=None):
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        elif eval_dataset is None:
            eval_dataset = self.eval_dataset
        return self._stream_loader(eval_dataset, "eval", self.args.eval_batch_size, 1, "Evaluation")

    def get_test_dataloader(self, test_dataset):
        return self._stream_loader(test_dataset, "eval", self.args.eval_batch_size, 1, "Test")

    # ---- the memory -------------------------------------------------------------------------------------------

    def run_model(self, model, inputs: dict, **loss_kwargs):
        inputs = dict(inputs)
        stream = inputs.pop("stream", None)
        if not isinstance(stream, StreamSlice):
            raise ValueError(
                "MemoryTrainer: the batch has no `stream` entry; use StreamWindows datasets with the default "
                "collator (collate_stream_windows)"
            )
        phase = "train" if model.training else "eval"
        layout = self._layouts[phase].layout
        lanes_per_rank = layout.accumulation * layout.rows
        owner = stream.lanes[0] // lanes_per_rank
        if owner != self.args.process_index or len(stream.lanes) != layout.rows:
            raise RuntimeError(
                f"process {self.args.process_index} got lanes {stream.lanes[0]}..{stream.lanes[-1]}, which belong to "
                f"process {owner}: the dataloader is not dealing whole batches to the processes in turn"
            )
        memories = self._memories[phase]
        entry = memories.get(stream.lanes)
        cache = None
        if entry is not None and entry[0] == stream.position:
            cache = entry[1]
        elif stream.position != 0 and phase == "train" and not self._warned_rebuild:
            logger.warning(
                "MemoryTrainer: no memory for lanes %d..%d at window %d (resumed from a checkpoint without saved "
                "memories, or with another lane layout): they start with an empty memory here",
                stream.lanes[0],
                stream.lanes[-1],
                stream.position,
            )
            self._warned_rebuild = True
        outputs = model(**inputs, cache=cache, use_cache=True, **loss_kwargs)
        memories[stream.lanes] = (stream.position + 1, outputs.cache.detach())
        return outputs

    def evaluation_loop(self, *args, **kwargs):
        self._memories["eval"] = {}  # every evaluation starts from an empty memory
        try:
            return super().evaluation_loop(*args, **kwargs)
        finally:
            self._memories["eval"] = {}

    # ---- checkpoints ------------------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None):
        if isinstance(resume_from_checkpoint, bool) and resume_from_checkpoint:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        self._memories["train"] = {}
        self._warned_rebuild = False
        self._resume_memory_from = resume_from_checkpoint or None
        return super().train(
            resume_from_checkpoint=resume_from_checkpoint, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval
        )

    def _save_checkpoint(self, model, trial) -> None:
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        os.makedirs(folder, exist_ok=True)
        streams = [
            {"lanes": list(lanes), "position": position, **memory_state(cache)}
            for lanes, (position, cache) in self._memories["train"].items()
        ]
        signature = self._layouts["train"].signature() if "train" in self._layouts else None
        payload = {"signature": signature, "streams": streams}
        torch.save(payload, os.path.join(folder, MEMORY_FILE.format(rank=self.args.process_index)))
        super()._save_checkpoint(model, trial)

    def _load_memories(self, checkpoint: str) -> None:
        """Every process's saved memories; this process takes the rows of its own lanes (any number of processes,
        accumulation steps and rows per device that keeps the lane layout: the global batch and the window)."""
        files = sorted(glob.glob(os.path.join(checkpoint, MEMORY_FILE.format(rank="*"))))
        files = [f for f in files if re.fullmatch(r"stream_memory_rank\d+\.pt", os.path.basename(f))]
        expected = self._layouts["train"].signature()
        if not files:
            logger.warning("MemoryTrainer: %s holds no saved memories: training resumes with empty ones", checkpoint)
            return
        rows = {}  # lane -> (position, cache on the CPU, row)
        for path in files:
            payload = torch.load(path, map_location="cpu", weights_only=True)
            if payload["signature"] != expected:
                logger.warning(
                    "MemoryTrainer: the memories in %s were saved for lanes %s, this run has %s: training resumes "
                    "with empty memories",
                    path,
                    payload["signature"],
                    expected,
                )
                self._memories["train"] = {}
                return
            for stream in payload["streams"]:
                cache = memory_from_state(stream)
                rows.update({lane: (int(stream["position"]), cache, row) for row, lane in enumerate(stream["lanes"])})
        layout = self._layouts["train"].layout
        for micro in range(layout.accumulation):  # this process's lanes, regrouped from whichever rows held them
            lanes = tuple(range(layout.global_batch)[layout.rows_of(self.args.process_index, micro)])
            held = [rows[lane] for lane in lanes if lane in rows]
            if len(held) == len(lanes) and len({position for position, _, _ in held}) == 1:
                joined = cache_of_rows([(source, row) for _, source, row in held], self.args.device)
                self._memories["train"][lanes] = (held[0][0], joined)
