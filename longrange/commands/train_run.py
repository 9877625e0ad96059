"""The training run behind `longrange train`: data, model and optimizer under Accelerate, the loop and the final
artefacts (model folder with its card, curves, samples, metrics). `longrange.commands.train` holds the options and
the pieces they select, `longrange.commands.train_checkpoint` what a checkpoint holds and how a run resumes from
it; this module holds one run's state and steps, and its report."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from longrange.commands.train_checkpoint import Checkpoints
from longrange.training import (
    TrainState,
    carries_cache,
    evaluate_stream,
    generate_samples,
    lm_loss_of,
    plot_curves,
    warmup_cosine,
)


def make_accelerator(args, output_dir: Path):
    from accelerate import Accelerator, DistributedDataParallelKwargs

    return Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        cpu=args.cpu,
        log_with=args.report_to or None,
        project_dir=str(output_dir),
        # the compression network only gets gradients once memories overflow; DDP must tolerate unused parameters
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)],
        # None: Accelerate's own setting (`accelerate launch --dynamo_backend ...`, its config file) applies
        dynamo_plugin=dynamo_plugin(args.compile),
    )


def dynamo_plugin(compile_mode: str | None):
    """`--compile`'s TorchDynamoPlugin (None without it). "regional": each decoder layer compiled alone (Accelerate's
    `use_regional_compilation`; the layers share their graphs), with static shapes: the Compressive layers meet a
    few memory lengths (empty, filling, full), each of which gets a graph of its own instead of one dynamic-shape
    graph, whose steps took 2.4x as long on the CPU (hidden 512 x 6, 1 x 2,048, bf16); "model": one graph for the
    whole model."""
    from accelerate.utils import TorchDynamoPlugin

    if compile_mode is None:
        return None
    if compile_mode == "regional":
        return TorchDynamoPlugin(backend="inductor", use_regional_compilation=True, dynamic=False)
    return TorchDynamoPlugin(backend="inductor")


def memory_modes(args, config) -> tuple[bool, bool, bool]:
    """(streaming, carry the memory across steps, carry it across validation windows), checked against each other."""
    streaming = args.model == "compressive" if args.streaming is None else args.streaming
    if args.segments_alone:
        if not carries_cache(config):
            raise SystemExit("--segments_alone is for a model with memory (--model compressive)")
        if args.carry_cache:
            raise SystemExit("--segments_alone trains every segment from an empty memory: drop --carry_cache")
        args.carry_cache = False
    carry = carries_cache(config) and streaming if args.carry_cache is None else args.carry_cache
    if carry and not (streaming and carries_cache(config)):
        raise SystemExit("--carry_cache needs --streaming and a model with memory (--model compressive)")
    # validation carries the memory across windows, except for a model trained without memory
    return streaming, carry, carries_cache(config) and not args.segments_alone


def is_fsdp1_unit(module) -> bool:
    """Whether FSDP1's wrapper (`FullyShardedDataParallel`) made `module` a unit of its own."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(module, FullyShardedDataParallel)


@torch.no_grad()
def replica_difference(accelerator, model) -> float:
    """Largest difference between the processes' fingerprints of the weights (0.0 when the replicas agree).

    Each parameter is reduced to its sum, sum of squares and a sum weighted by fixed pseudo-random numbers (float64),
    so identical weights give identical fingerprints and a single differing entry shows up.
    """
    rows = []
    for i, p in enumerate(model.parameters()):
        flat = p.detach().double().flatten()
        weights = torch.sin(torch.arange(flat.numel(), dtype=torch.float64, device=flat.device) * 0.7 + i)
        rows.append(torch.stack([flat.sum(), (flat * flat).sum(), (flat * weights).sum()]))
    fingerprint = torch.stack(rows)[None]  # [1, parameters, 3]
    everyone = accelerator.gather(fingerprint)  # [processes, parameters, 3]
    return float((everyone - everyone[:1]).abs().max())


def bar_postfix(lm: float, rec: float | None, tokens_per_s: float, bits_per_byte: float | None) -> dict[str, str]:
    """What the progress bar shows: the step's language-model loss, tokens/s since the start, the latest validation."""
    postfix = {"loss": f"{lm:.3f}", "tok/s": f"{tokens_per_s:,.0f}"}
    if rec is not None:
        postfix["rec"] = f"{rec:.4f}"
    if bits_per_byte is not None:
        postfix["val_bpb"] = f"{bits_per_byte:.3f}"
    return postfix


class TrainingRun:
    """One run of `longrange train`: built from the parsed options, then `resume()`, `train()`, `finish()`."""

    def __init__(self, args, parts):
        from accelerate.utils import set_seed

        self.args, self.parts = args, parts
        self.output_dir = Path(args.output_dir)
        self.accelerator = make_accelerator(args, self.output_dir)
        self.main_process = self.accelerator.is_main_process
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        set_seed(args.seed)
        if self.main_process:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        self.accelerator.wait_for_everyone()
        self._build_data()
        self._build_model()
        self.state = TrainState()
        self.accelerator.register_for_checkpointing(self.scheduler, self.state)
        # how this run spreads its global batch, recorded in its checkpoints
        layout = dict(processes=self.world, accumulation=args.gradient_accumulation_steps, rows=args.batch_size,
                      global_batch=self.global_batch, window=args.window)  # fmt: skip
        self.checkpoints = Checkpoints(self.accelerator, self.output_dir, layout, self.batcher.layout, self.carry)
        self.caches: list = [None] * args.gradient_accumulation_steps  # one carried memory per micro-step's rows
        self.last_eval: dict | None = None
        self.last_losses: tuple[float, float | None] = (math.nan, None)  # the bar's: lm, reconstruction
        self.bar = None

    def _build_data(self) -> None:
        from longrange.data import RandomWindowBatcher, StreamBatcher, check_window, eval_windows

        args, accelerator = self.args, self.accelerator
        self.corpus, self.tokenizer, self.streams = self.parts.load_data(args, accelerator)
        self.config = config = self.parts.build_config(args, self.tokenizer)
        if args.window is None:
            args.window = 2 * config.segment_length if args.model == "compressive" else 4 * config.bucket_size
        check_window(args.window, config)
        self.streaming, self.carry, self.eval_carry = memory_modes(args, config)
        self.world, accumulation = accelerator.num_processes, args.gradient_accumulation_steps
        self.global_batch = args.batch_size * self.world * accumulation
        batcher_cls = StreamBatcher if self.streaming else RandomWindowBatcher
        extra = {} if self.streaming else {"seed": args.seed}
        self.batcher = batcher_cls(self.streams.ids["train"], args.window, self.global_batch, self.world,
                                   accumulation, **extra)  # fmt: skip
        eval_ids = self.streams.ids["validation"][: args.eval_tokens or None]
        self.eval_batches = [self.as_rows(b) for b in eval_windows(eval_ids, args.window, args.eval_batch_size)]

    def as_rows(self, batch: torch.Tensor) -> torch.Tensor:
        """--segments_alone: [rows, window] -> [rows * segments, segment_length] (each segment its own row)."""
        return batch.reshape(-1, self.config.segment_length) if self.args.segments_alone else batch

    def _build_model(self) -> None:
        from accelerate.utils import DistributedType
        from transformers import AutoModelForCausalLM

        args, accelerator = self.args, self.accelerator
        model = AutoModelForCausalLM.from_config(self.config)
        self.n_params = sum(p.numel() for p in model.parameters())
        describe(self)
        optimizer = self.parts.build_optimizer(model, args)
        warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.max_steps // 20)
        schedule = warmup_cosine(warmup, args.max_steps, args.min_lr_ratio)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        # The scheduler is stepped by hand once per optimizer step (a prepared scheduler would step once per process).
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        self.fsdp = accelerator.distributed_type == DistributedType.FSDP
        layers = accelerator.unwrap_model(self.model).model.layers
        if self.fsdp and args.model == "compressive" and any(is_fsdp1_unit(m) for m in layers):
            raise SystemExit(
                "FSDP: the Compressive model calls methods of its decoder layers outside their forward (positions, "
                "the memory update), which FSDP1's per-layer wrappers do not gather; use FSDP2 (fsdp_version: 2, as "
                "configs/accelerate/fsdp.yaml) or shard the root alone (configs/accelerate/fsdp_root.yaml)"
            )

    def resume(self) -> None:
        """--resume_from (a checkpoint folder, or "latest": the newest under --output_dir): model, optimizer,
        scheduler, step, curves, RNG states and carried memories (see `Checkpoints.load`)."""
        args = self.args
        if not args.resume_from:
            return
        resume = Path(args.resume_from)
        if args.resume_from == "latest":
            found = self.parts.checkpoint_dirs(self.output_dir)
            if not found:
                raise SystemExit(f"--resume_from latest: no checkpoint under {self.output_dir / 'checkpoints'}")
            resume = found[-1]
        if not resume.is_dir():
            raise SystemExit(f"--resume_from: no such checkpoint folder {resume}")
        carried = self.checkpoints.load(resume, self.state)
        if carried is not None:
            self.caches = carried
        self.accelerator.print(f"resumed from {resume} at step {self.state.step}")

    def step(self) -> tuple[torch.Tensor, bool]:
        """One optimizer step over the accumulation micro-steps: the mean (loss, lm loss, reconstruction loss) of
        this process, and whether the model has a reconstruction loss."""
        args, accelerator, model = self.args, self.accelerator, self.model
        accumulation = args.gradient_accumulation_steps
        if self.carry and self.batcher.starts_epoch(self.state.step):
            self.caches = [None] * accumulation  # the lanes restart from their beginnings: old memories do not apply
        sums = torch.zeros(3, device=accelerator.device)
        for micro in range(accumulation):
            batch = self.batcher.batch(self.state.step, accelerator.process_index, micro)
            batch = self.as_rows(batch).to(accelerator.device)
            with accelerator.accumulate(model):
                if self.carry:
                    out = model(input_ids=batch, labels=batch, cache=self.caches[micro], use_cache=True)
                    self.caches[micro] = out.cache
                else:
                    out = model(input_ids=batch, labels=batch, use_cache=False)
                accelerator.backward(out.loss)
                if accelerator.sync_gradients and args.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            rec = getattr(out, "reconstruction_loss", None)
            rec = rec.detach().float() if rec is not None else torch.zeros((), device=sums.device)
            sums += torch.stack([out.loss.detach().float(), lm_loss_of(out).detach().float(), rec]) / accumulation
        self.scheduler.step()
        return sums, getattr(out, "reconstruction_loss", None) is not None

    def train(self) -> None:
        """Steps up to --max_steps with logging, validation every --eval_every and checkpoints every --save_every."""
        from tqdm.auto import tqdm

        args, state = self.args, self.state
        tokens_per_step = self.global_batch * args.window
        self.bar = tqdm(total=args.max_steps, initial=state.step, disable=not self.main_process,
                        desc=f"train {args.model}", dynamic_ncols=True)  # fmt: skip
        self.model.train()
        self.started, self.started_step = time.perf_counter(), state.step
        while state.step < args.max_steps:
            sums, has_rec = self.step()
            state.step += 1
            state.tokens += tokens_per_step
            loss, lm, rec = self.accelerator.reduce(sums, reduction="mean").tolist()
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss became {loss} at step {state.step}; lower --learning_rate")
            if state.step % args.log_every == 0 or state.step == args.max_steps:
                self._log_train(loss, lm, rec if has_rec else None)
            if args.eval_every and (state.step % args.eval_every == 0 or state.step == args.max_steps):
                self.validate()
            self.last_losses = (lm, rec if has_rec else None)
            latest = self.last_eval["bits_per_byte"] if self.last_eval else None
            self.bar.set_postfix(bar_postfix(*self.last_losses, self.tokens_per_s(), latest), refresh=False)
            self.bar.update(1)
            if args.save_every and state.step % args.save_every == 0 and state.step < args.max_steps:
                self.checkpoints.save(self.state, self.caches)
        self.elapsed = time.perf_counter() - self.started

    def tokens_per_s(self) -> float:
        """Training tokens per second since this process started (or resumed) training, validation included."""
        trained = (self.state.step - self.started_step) * self.global_batch * self.args.window
        return trained / max(1e-9, time.perf_counter() - self.started)

    def _log_train(self, loss: float, lm: float, rec: float | None) -> None:
        record = {"step": self.state.step, "loss": loss, "lm_loss": lm, "lr": self.scheduler.get_last_lr()[0],
                  "tokens_per_s": self.tokens_per_s(), "reconstruction_loss": rec}  # fmt: skip
        self.state.history["train"].append(record)
        logged = {f"train/{k}": v for k, v in record.items() if v is not None and k != "step"}
        self.accelerator.log(logged, self.state.step)

    def _stream_scores(self, model, split: str, batches) -> dict[str, float]:
        return evaluate_stream(model, batches, carry_cache=self.eval_carry,
                               bytes_per_token=self.streams.bytes_per_token(split),
                               chars_per_token=self.streams.chars_per_token(split))  # fmt: skip

    def validate(self) -> None:
        """Validation bits per byte / char on --eval_tokens of the validation split (every process under FSDP)."""
        if self.main_process or self.fsdp:  # under FSDP every process takes part in the forward's parameter gathering
            model = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
            self.last_eval = self._stream_scores(model, "validation", self.eval_batches)
            self.state.history["validation"].append({"step": self.state.step, **self.last_eval})
            e = self.last_eval
            if self.main_process:
                self.bar.write(
                    f"step {self.state.step}: validation loss {e['loss']:.4f}, ppl {e['perplexity']:.2f}, "
                    f"{e['bits_per_byte']:.4f} bits/byte, {e['bits_per_char']:.4f} bits/char"
                )
            self.accelerator.log({f"validation/{k}": v for k, v in e.items()}, self.state.step)
        self.accelerator.wait_for_everyone()

    def finish(self) -> dict:
        """Last checkpoint, then on the main process the model folder, metrics, curves and samples (`write_report`);
        the run's summary."""
        self.checkpoints.save(self.state, self.caches)
        model = final_model(self)
        result = {"output_dir": str(self.output_dir), "steps": self.state.step, "parameters": self.n_params,
                  "train_history": self.state.history["train"]}  # fmt: skip
        if model is not None:
            result["metrics"] = write_report(self, model)
        else:
            self.bar.close()
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()
        return result


def describe(run: TrainingRun) -> None:
    """The run's first line: model size, corpus, window, batch layout and memory mode."""
    args, streams = run.args, run.streams
    run.accelerator.print(
        f"{args.model}: {run.n_params / 1e6:.2f}M parameters | corpus {run.corpus.name} (split by "
        f"{run.corpus.split_by}): {len(streams.ids['train']):,} train / {len(streams.ids['validation']):,} "
        f"validation tokens | window {args.window}, global batch {run.global_batch} = {run.world} process(es) "
        f"x {args.gradient_accumulation_steps} accumulation x {args.batch_size} rows | "
        f"{'streaming' if run.streaming else 'random windows'}"
        f"{', memory carried across steps' if run.carry else ''}"
        f"{', every segment alone (no memory)' if args.segments_alone else ''}"
    )


def write_samples(run: TrainingRun, model) -> None:
    """--num_samples continuations of the prompts (default: from the corpus) into samples.txt, and printed."""
    args = run.args
    if not args.num_samples:
        return
    prompts = args.prompts or run.parts.default_prompts(run.corpus, args.num_samples)
    samples = generate_samples(model, run.tokenizer, prompts[: args.num_samples],
                               max_new_tokens=args.sample_tokens)  # fmt: skip
    text = "".join(f"=== sample {i + 1} (prompt {p!r}) ===\n{s}\n\n" for i, (p, s) in
                   enumerate(zip(prompts, samples)))  # fmt: skip
    (run.output_dir / "samples.txt").write_text(text, encoding="utf-8")
    print(text, end="")


def final_model(run: TrainingRun):
    """The trained model as a plain module on the main process (gathered from the shards under FSDP; every
    process takes part), None on the others; also logs how far the replicas drifted apart."""
    from transformers import AutoModelForCausalLM

    accelerator = run.accelerator
    # FSDP: each process holds shards, so there are no replicas to compare; the whole weights are gathered instead
    unwrapped = accelerator.unwrap_model(run.model, keep_torch_compile=False)
    run.replica_diff = None if run.fsdp else replica_difference(accelerator, unwrapped)
    full_state = accelerator.get_state_dict(run.model) if run.fsdp else None  # a collective: every process
    if run.replica_diff is not None and run.world > 1:
        accelerator.print(f"replicas: largest difference between the processes' weight fingerprints "
                          f"{run.replica_diff:.3g}")  # fmt: skip
    if not run.main_process:
        return None
    if run.fsdp:  # evaluation and samples below run on this process alone: a plain model with the gathered weights
        unwrapped = AutoModelForCausalLM.from_config(run.config)
        unwrapped.load_state_dict(full_state)
        unwrapped.to(accelerator.device)
    return unwrapped


def final_metrics(run: TrainingRun, model) -> dict:
    """Validation at the last step (the one the loop ran, else a new one), test, tokens/s, processes."""
    args, state = run.args, run.state
    history = state.history["validation"]
    if not history or history[-1]["step"] != state.step:
        run.last_eval = run._stream_scores(model, "validation", run.eval_batches)
        history.append({"step": state.step, **run.last_eval})
    metrics = dict(run.last_eval)
    test_ids = run.streams.ids["test"]
    if len(test_ids) >= args.window:
        from longrange.data import eval_windows

        batches = eval_windows(test_ids[: args.eval_tokens or None], args.window, args.eval_batch_size)
        test = run._stream_scores(model, "test", [run.as_rows(b) for b in batches])
        metrics.update({f"test_{k}": v for k, v in test.items()})
    trained_tokens = (state.step - run.started_step) * run.global_batch * args.window
    metrics["train_tokens_per_s"] = trained_tokens / max(1e-9, run.elapsed)
    metrics["processes"] = run.world
    metrics["replica_max_difference"] = run.replica_diff
    return metrics


def write_report(run: TrainingRun, model) -> dict:
    """The main process's end of a run: the model folder with tokenizer and card, the final metrics (returned) in
    metrics.json, the curves, the samples and a last line naming what it wrote."""
    args, output_dir = run.args, run.output_dir
    final = output_dir / "model"
    model.save_pretrained(final)
    run.tokenizer.save_pretrained(final)
    metrics = final_metrics(run, model)
    # the bar's last figures are the summary's: tokens/s over the whole run, validation at the last step
    run.bar.set_postfix(bar_postfix(*run.last_losses, metrics["train_tokens_per_s"], metrics.get("bits_per_byte")))
    run.bar.close()
    (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    run.parts.write_card(final, model, run.tokenizer, run.corpus, metrics, args)
    plot_curves(run.state.history, output_dir / "curves.png", title=f"{args.model} on {run.corpus.name}")
    write_samples(run, model)
    print(
        f"done: {run.state.step} steps, {metrics['train_tokens_per_s']:,.0f} tokens/s; validation "
        f"{metrics.get('bits_per_byte', float('nan')):.4f} bits/byte; wrote {final}, "
        f"{output_dir / 'curves.png'}, {output_dir / 'samples.txt'}, {output_dir / 'metrics.json'}"
    )
    return metrics
