#!/usr/bin/env python
"""Train a Compressive or Sinkhorn language model with Accelerate.

    python scripts/train.py                                   # small Compressive model, stdlib corpus, byte tokenizer
    python scripts/train.py --model sinkhorn --data ../shared/data/tinyshakespeare.txt --split 0.9,0.1
    accelerate launch --num_processes 2 scripts/train.py --config hidden_size=128 --max_steps 100

Runs alone or under `accelerate launch` (data-parallel: every process takes its own rows of one global batch, so the
result does not depend on how the batch is spread over processes and accumulation steps). Writes, under
`--output_dir`: checkpoints (`accelerator.save_state`, exact resume with `--resume_from`), the trained model as a
`save_pretrained` folder with tokenizer and model card, `curves.png`, `samples.txt` and `metrics.json`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

# scripts/ holds evaluate.py: it must never shadow the `evaluate` library for anything imported from here
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if __package__ in (None, ""):  # `python scripts/train.py` from a checkout: make `longrange` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# A small model that trains in a few minutes on 2 CPU cores. Any field can be overridden with --config key=value.
SMALL_CONFIGS = {
    "compressive": dict(
        hidden_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=512,
        segment_length=64,
        mem_len=64,
        c_mem_len=32,
        compression_rate=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    ),
    "sinkhorn": dict(
        hidden_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=512,
        bucket_size=32,
        causal=True,
        max_position_embeddings=1024,
    ),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=sorted(SMALL_CONFIGS), default="compressive")
    g.add_argument(
        "--config",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="config overrides, e.g. hidden_size=256 num_hidden_layers=6 pkm_layers=[2]; a key the model's config "
        "does not define is refused with the list of valid keys",
    )
    g = p.add_argument_group("data")
    g.add_argument(
        "--data", default=None, help="text file, folder or Hub dataset name (default: Python stdlib sources)"
    )
    g.add_argument("--dataset_config", default=None, help="Hub dataset configuration name")
    g.add_argument("--split", default="0.9,0.05,0.05", help="train,validation[,test] fractions (default 0.9,0.05,0.05)")
    g.add_argument("--max_corpus_bytes", type=int, default=4_000_000, help="cap on the default stdlib corpus")
    g.add_argument("--tokenizer", default="byte", help="byte | bpe | gpt2 | gpt2:<dir> | saved folder or Hub id")
    g.add_argument("--bpe_vocab_size", type=int, default=4096)
    g.add_argument("--window", type=int, default=None, help="tokens per row and step (default: 2 segments / 4 buckets)")
    g.add_argument(
        "--streaming",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Transformer-XL batches: each row continues where it stopped (default: on for compressive)",
    )
    g.add_argument(
        "--carry_cache",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="carry the Compressive memory from step to step (default: on when streaming a compressive model)",
    )
    g.add_argument(
        "--segments_alone",
        action="store_true",
        help="Compressive without any memory: every segment of a window is its own row (same tokens per step), from "
        "an empty memory, in training and in validation (the no-memory baseline; implies --no-carry_cache)",
    )
    g = p.add_argument_group("optimisation")
    g.add_argument("--max_steps", type=int, default=1200, help="optimizer steps")
    g.add_argument("--batch_size", type=int, default=8, help="rows per process and accumulation micro-step")
    g.add_argument("--gradient_accumulation_steps", type=int, default=1)
    g.add_argument("--learning_rate", type=float, default=2e-3)
    g.add_argument("--weight_decay", type=float, default=0.01)
    g.add_argument("--warmup_steps", type=int, default=None, help="default: 5%% of max_steps")
    g.add_argument("--min_lr_ratio", type=float, default=0.1, help="cosine decays to this fraction of the peak")
    g.add_argument("--max_grad_norm", type=float, default=1.0, help="0 disables clipping")
    g.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="no")
    g.add_argument("--cpu", action="store_true", help="train on the CPU even when a GPU is present")
    g.add_argument(
        "--compile",
        action="store_true",
        help="train the model compiled with torch.compile (inductor, graph breaks allowed): Accelerate's "
        "TorchDynamoPlugin, as `accelerate launch --dynamo_backend inductor`; evaluation and samples run uncompiled",
    )
    g.add_argument(
        "--num_threads",
        type=int,
        default=1,
        help="torch CPU threads per process (default 1: small models gain little from more, and several threads per "
        "process collapse when the CPU is shared; 0 keeps torch's default, better for large models on idle many-core CPUs)",
    )
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("evaluation, checkpoints and outputs")
    g.add_argument("--eval_every", type=int, default=200)
    g.add_argument("--eval_tokens", type=int, default=32768, help="validation tokens per evaluation (0 = all)")
    g.add_argument("--eval_batch_size", type=int, default=8)
    g.add_argument("--log_every", type=int, default=10)
    g.add_argument("--save_every", type=int, default=400, help="checkpoint every N steps (0 = only at the end)")
    g.add_argument("--resume_from", default=None, help="checkpoint folder, or 'latest' (newest under output_dir)")
    g.add_argument("--output_dir", default=None, help="default: outputs/<model>-<corpus>")
    g.add_argument("--report_to", nargs="*", default=[], help="Accelerate trackers, e.g. tensorboard wandb")
    g.add_argument("--num_samples", type=int, default=3, help="generated samples at the end (0 = none)")
    g.add_argument("--sample_tokens", type=int, default=200)
    g.add_argument("--prompts", nargs="*", default=None, help="sample prompts (default: taken from the corpus)")
    args = p.parse_args(argv)
    args.split = tuple(float(x) for x in args.split.split(","))
    from longrange import CompressiveConfig, SinkhornConfig
    from longrange.training import parse_config_overrides

    config_class = {"compressive": CompressiveConfig, "sinkhorn": SinkhornConfig}[args.model]
    try:  # checked before anything is loaded or trained
        args.config = parse_config_overrides(args.config, config_class)
    except ValueError as err:
        p.error(str(err))
    return args


def build_config(args, tokenizer):
    from transformers import AutoConfig

    import longrange  # noqa: F401  (registers the model types)

    fields = dict(SMALL_CONFIGS[args.model])
    fields.update(args.config)  # already checked against the config's fields by parse_args
    fields.setdefault("vocab_size", len(tokenizer))
    if fields["vocab_size"] < len(tokenizer):
        raise SystemExit(f"vocab_size={fields['vocab_size']} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        fields.setdefault(name, getattr(tokenizer, name))
    return AutoConfig.for_model(args.model, **fields)


def build_optimizer(model, args) -> torch.optim.Optimizer:
    # no weight decay on biases, norms and other vectors
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.learning_rate, betas=(0.9, 0.98), eps=1e-8)


def load_data(args, accelerator):
    """Corpus -> tokenizer -> one stream per split. A trained BPE is built on the main process and shared."""
    from longrange.data import load_corpus, tokenize_corpus
    from longrange.tokenization import byte_tokenizer, load_tokenizer

    as_bytes = args.tokenizer == "byte"
    corpus = load_corpus(args.data, dataset_config=args.dataset_config, split=args.split, as_bytes=as_bytes,
                         max_bytes=args.max_corpus_bytes)  # fmt: skip
    if args.tokenizer == "byte":
        tokenizer = byte_tokenizer()
    elif args.tokenizer == "bpe":
        shared = Path(args.output_dir) / "tokenizer"
        if accelerator.is_main_process:
            tokenizer = load_tokenizer("bpe", texts=corpus.splits["train"], vocab_size=args.bpe_vocab_size)
            tokenizer.save_pretrained(shared)
        accelerator.wait_for_everyone()
        tokenizer = load_tokenizer(str(shared))
    else:
        tokenizer = load_tokenizer(args.tokenizer)
    return corpus, tokenizer, tokenize_corpus(corpus, tokenizer)


def default_prompts(corpus, n: int) -> list[str]:
    if corpus.name == "python-stdlib":
        return ["import ", "def ", "class "][:n] + ["\n"] * max(0, n - 3)
    text = corpus.splits["validation"][0] if corpus.splits["validation"] else corpus.splits["train"][0]
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    # start each prompt at the beginning of a line, at evenly spaced places of the validation text
    starts = [int(i * len(text) / max(1, n)) for i in range(n)]
    starts = [0 if s == 0 else text.find("\n", s) + 1 for s in starts]
    return [text[s : s + 24] for s in starts]


def checkpoint_dirs(output_dir: Path) -> list[Path]:
    root = output_dir / "checkpoints"
    return sorted(root.glob("step_*"), key=lambda p: int(p.name.split("_")[1])) if root.is_dir() else []


def main(argv=None) -> dict:
    args = parse_args(argv)
    from accelerate import Accelerator, DistributedDataParallelKwargs
    from accelerate.utils import DistributedType, TorchDynamoPlugin, set_seed
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    from longrange.data import RandomWindowBatcher, StreamBatcher, check_window, eval_windows
    from longrange.training import (
        TrainState,
        carries_cache,
        evaluate_stream,
        generate_samples,
        lm_loss_of,
        plot_curves,
        warmup_cosine,
    )

    if args.output_dir is None:
        corpus_name = "stdlib" if args.data is None else Path(str(args.data)).stem
        args.output_dir = f"outputs/{args.model}-{corpus_name}"
    output_dir = Path(args.output_dir)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        cpu=args.cpu,
        log_with=args.report_to or None,
        project_dir=str(output_dir),
        # the compression network only gets gradients once memories overflow; DDP must tolerate unused parameters
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)],
        # None: Accelerate's own setting (`accelerate launch --dynamo_backend ...`, its config file) applies
        dynamo_plugin=TorchDynamoPlugin(backend="inductor") if args.compile else None,
    )
    main_process = accelerator.is_main_process
    log = accelerator.print
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    set_seed(args.seed)

    # ---- data and model ----------------------------------------------------------------------------------------
    if main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    corpus, tokenizer, streams = load_data(args, accelerator)
    config = build_config(args, tokenizer)
    if args.window is None:
        args.window = 2 * config.segment_length if args.model == "compressive" else 4 * config.bucket_size
    check_window(args.window, config)
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
    eval_carry = carries_cache(config) and not args.segments_alone

    def as_rows(batch: torch.Tensor) -> torch.Tensor:
        """--segments_alone: [rows, window] -> [rows * segments, segment_length] (each segment its own row)."""
        return batch.reshape(-1, config.segment_length) if args.segments_alone else batch

    world, accumulation = accelerator.num_processes, args.gradient_accumulation_steps
    global_batch = args.batch_size * world * accumulation
    batcher_cls = StreamBatcher if streaming else RandomWindowBatcher
    extra = {} if streaming else {"seed": args.seed}
    batcher = batcher_cls(streams.ids["train"], args.window, global_batch, world, accumulation, **extra)
    eval_ids = streams.ids["validation"][: args.eval_tokens or None]
    eval_batches = [as_rows(b) for b in eval_windows(eval_ids, args.window, args.eval_batch_size)]

    model = AutoModelForCausalLM.from_config(config)
    n_params = sum(p.numel() for p in model.parameters())
    log(
        f"{args.model}: {n_params / 1e6:.2f}M parameters | corpus {corpus.name} (split by {corpus.split_by}): "
        f"{len(streams.ids['train']):,} train / {len(streams.ids['validation']):,} validation tokens | "
        f"window {args.window}, global batch {global_batch} = {world} process(es) x {accumulation} accumulation x "
        f"{args.batch_size} rows | {'streaming' if streaming else 'random windows'}"
        f"{', memory carried across steps' if carry else ''}"
        f"{', every segment alone (no memory)' if args.segments_alone else ''}"
    )
    optimizer = build_optimizer(model, args)
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, args.max_steps // 20)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(warmup, args.max_steps, args.min_lr_ratio))
    # The scheduler is stepped by hand once per optimizer step (a prepared scheduler would step once per process).
    model, optimizer = accelerator.prepare(model, optimizer)
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    if (
        fsdp
        and args.model == "compressive"
        and any(is_fsdp1_unit(m) for m in accelerator.unwrap_model(model).model.layers)
    ):
        raise SystemExit(
            "FSDP: the Compressive model calls methods of its decoder layers outside their forward (positions, the "
            "memory update), which FSDP1's per-layer wrappers do not gather; use FSDP2 (fsdp_version: 2, as "
            "configs/accelerate/fsdp.yaml) or shard the root alone (configs/accelerate/fsdp_root.yaml)"
        )
    state = TrainState()
    accelerator.register_for_checkpointing(scheduler, state)
    caches: list = [None] * accumulation  # one carried memory per accumulation micro-step (= its rows)

    if args.resume_from:
        resume = Path(args.resume_from)
        if args.resume_from == "latest":
            found = checkpoint_dirs(output_dir)
            if not found:
                raise SystemExit(f"--resume_from latest: no checkpoint under {output_dir / 'checkpoints'}")
            resume = found[-1]
        if not resume.is_dir():
            raise SystemExit(f"--resume_from: no such checkpoint folder {resume}")
        accelerator.load_state(str(resume))
        cache_file = resume / f"stream_cache_rank{accelerator.process_index}.pt"
        if carry and cache_file.is_file():
            caches = torch.load(cache_file, map_location=accelerator.device, weights_only=False)
        log(f"resumed from {resume} at step {state.step}")

    def save_checkpoint() -> None:
        folder = output_dir / "checkpoints" / f"step_{state.step}"
        accelerator.save_state(str(folder))  # model, optimizer, scheduler, TrainState, RNG states of every process
        if carry:  # each process's memories continue its own rows
            torch.save(caches, folder / f"stream_cache_rank{accelerator.process_index}.pt")
        accelerator.wait_for_everyone()

    if args.report_to:
        accelerator.init_trackers("longrange", config={k: str(v) for k, v in vars(args).items()})

    # ---- training loop -----------------------------------------------------------------------------------------
    tokens_per_step = global_batch * args.window
    bar = tqdm(total=args.max_steps, initial=state.step, disable=not main_process, desc=f"train {args.model}",
               dynamic_ncols=True)  # fmt: skip
    model.train()
    last_eval = None
    started, started_step = time.perf_counter(), state.step
    while state.step < args.max_steps:
        step_start = time.perf_counter()
        if carry and batcher.starts_epoch(state.step):
            caches = [None] * accumulation  # the lanes restart from their beginnings: old memories do not apply
        sums = torch.zeros(3, device=accelerator.device)  # loss, lm loss, reconstruction loss
        for micro in range(accumulation):
            batch = as_rows(batcher.batch(state.step, accelerator.process_index, micro)).to(accelerator.device)
            with accelerator.accumulate(model):
                if carry:
                    out = model(input_ids=batch, labels=batch, cache=caches[micro], use_cache=True)
                    caches[micro] = out.cache
                else:
                    out = model(input_ids=batch, labels=batch, use_cache=False)
                accelerator.backward(out.loss)
                if accelerator.sync_gradients and args.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            rec = getattr(out, "reconstruction_loss", None)
            sums += torch.stack(
                [out.loss.detach().float(), lm_loss_of(out).detach().float(),
                 rec.detach().float() if rec is not None else torch.zeros((), device=sums.device)]
            ) / accumulation  # fmt: skip
        scheduler.step()
        state.step += 1
        state.tokens += tokens_per_step
        loss, lm, rec = accelerator.reduce(sums, reduction="mean").tolist()
        tokens_per_s = tokens_per_step / max(1e-9, time.perf_counter() - step_start)
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss became {loss} at step {state.step}; lower --learning_rate")
        has_rec = getattr(out, "reconstruction_loss", None) is not None
        if state.step % args.log_every == 0 or state.step == args.max_steps:
            record = {"step": state.step, "loss": loss, "lm_loss": lm, "lr": scheduler.get_last_lr()[0],
                      "tokens_per_s": tokens_per_s, "reconstruction_loss": rec if has_rec else None}  # fmt: skip
            state.history["train"].append(record)
            accelerator.log({f"train/{k}": v for k, v in record.items() if v is not None and k != "step"}, state.step)
        postfix = {"loss": f"{lm:.3f}", "tok/s": f"{tokens_per_s:,.0f}"}
        if has_rec:
            postfix["rec"] = f"{rec:.4f}"
        if last_eval:
            postfix["val_bpb"] = f"{last_eval['bits_per_byte']:.3f}"
        bar.set_postfix(postfix, refresh=False)
        bar.update(1)

        if args.eval_every and (state.step % args.eval_every == 0 or state.step == args.max_steps):
            if main_process or fsdp:  # under FSDP every process takes part in the forward's parameter gathering
                last_eval = evaluate_stream(
                    accelerator.unwrap_model(model, keep_torch_compile=False), eval_batches,
                    carry_cache=eval_carry,
                    bytes_per_token=streams.bytes_per_token("validation"),
                    chars_per_token=streams.chars_per_token("validation"),
                )  # fmt: skip
                state.history["validation"].append({"step": state.step, **last_eval})
                if main_process:
                    bar.write(
                        f"step {state.step}: validation loss {last_eval['loss']:.4f}, ppl {last_eval['perplexity']:.2f}, "
                        f"{last_eval['bits_per_byte']:.4f} bits/byte, {last_eval['bits_per_char']:.4f} bits/char"
                    )
                accelerator.log({f"validation/{k}": v for k, v in last_eval.items()}, state.step)
            accelerator.wait_for_everyone()
        if args.save_every and state.step % args.save_every == 0 and state.step < args.max_steps:
            save_checkpoint()
    bar.close()
    elapsed = time.perf_counter() - started
    save_checkpoint()
    # FSDP: each process holds shards, so there are no replicas to compare; the whole weights are gathered instead
    replica_diff = (
        None if fsdp else replica_difference(accelerator, accelerator.unwrap_model(model, keep_torch_compile=False))
    )
    full_state = accelerator.get_state_dict(model) if fsdp else None  # a collective: every process calls it

    # ---- final artefacts -----------------------------------------------------------------------------------------
    result = {"output_dir": str(output_dir), "steps": state.step, "parameters": n_params,
              "train_history": state.history["train"]}  # fmt: skip
    if replica_diff is not None and world > 1:
        log(f"replicas: largest difference between the processes' weight fingerprints {replica_diff:.3g}")
    if main_process:
        unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
        if fsdp:  # evaluation and samples below run on this process alone: a plain model with the gathered weights
            unwrapped = AutoModelForCausalLM.from_config(config)
            unwrapped.load_state_dict(full_state)
            unwrapped.to(accelerator.device)
        final = output_dir / "model"
        unwrapped.save_pretrained(final)
        tokenizer.save_pretrained(final)
        if not state.history["validation"] or state.history["validation"][-1]["step"] != state.step:
            last_eval = evaluate_stream(
                unwrapped, eval_batches, carry_cache=eval_carry,
                bytes_per_token=streams.bytes_per_token("validation"),
                chars_per_token=streams.chars_per_token("validation"),
            )  # fmt: skip
            state.history["validation"].append({"step": state.step, **last_eval})
        metrics = dict(last_eval)
        test_ids = streams.ids["test"]
        if len(test_ids) >= args.window:
            test_batches = eval_windows(test_ids[: args.eval_tokens or None], args.window, args.eval_batch_size)
            test = evaluate_stream(
                unwrapped, [as_rows(b) for b in test_batches], carry_cache=eval_carry,
                bytes_per_token=streams.bytes_per_token("test"), chars_per_token=streams.chars_per_token("test"),
            )  # fmt: skip
            metrics.update({f"test_{k}": v for k, v in test.items()})
        trained_tokens = (state.step - started_step) * tokens_per_step
        metrics["train_tokens_per_s"] = trained_tokens / max(1e-9, elapsed)
        metrics["processes"] = world
        metrics["replica_max_difference"] = replica_diff
        result["metrics"] = metrics
        (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
        write_card(final, unwrapped, tokenizer, corpus, metrics, args)
        plot_curves(state.history, output_dir / "curves.png", title=f"{args.model} on {corpus.name}")
        if args.num_samples:
            prompts = args.prompts or default_prompts(corpus, args.num_samples)
            samples = generate_samples(unwrapped, tokenizer, prompts[: args.num_samples],
                                       max_new_tokens=args.sample_tokens)  # fmt: skip
            text = "".join(f"=== sample {i + 1} (prompt {p!r}) ===\n{s}\n\n" for i, (p, s) in
                           enumerate(zip(prompts, samples)))  # fmt: skip
            (output_dir / "samples.txt").write_text(text, encoding="utf-8")
            print(text, end="")
        print(
            f"done: {state.step} steps, {metrics['train_tokens_per_s']:,.0f} tokens/s; validation "
            f"{metrics.get('bits_per_byte', float('nan')):.4f} bits/byte; wrote {final}, {output_dir / 'curves.png'}, "
            f"{output_dir / 'samples.txt'}, {output_dir / 'metrics.json'}"
        )
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return result


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


def write_card(folder: Path, model, tokenizer, corpus, metrics: dict, args) -> None:
    split = "/".join(f"{f:g}" for f in args.split)
    dataset = f"{corpus.name} (train/validation/test {split}, split by {corpus.split_by})"
    if corpus.name == "python-stdlib":
        dataset = f"the Python standard library's own source files, {dataset}"
    from longrange.hub import write_model_card

    shown = {k: v for k, v in metrics.items() if k in ("loss", "perplexity", "bits_per_byte", "bits_per_char",
                                                       "test_bits_per_byte", "test_bits_per_char")}  # fmt: skip
    training_args = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()}
    write_model_card(folder, model=model, tokenizer=tokenizer, dataset=dataset,
                     metrics={f"validation {k}" if not k.startswith("test") else k: v for k, v in shown.items()},
                     training_args=training_args)  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
