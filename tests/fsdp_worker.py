"""Worker for tests/test_fsdp.py: a few training steps of a tiny model, alone or as one rank of FSDP2 (gloo, CPU).

    python tests/fsdp_worker.py --model sinkhorn --out one.pt                                   # one process
    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/fsdp_worker.py ... --out two.pt

Every process draws the same global batches; under FSDP each rank trains on its own rows of each batch, and the
FSDP units are chosen by Accelerate's FSDP2 auto-wrapping from an Accelerate config file (`--accelerate_config`):
with `TRANSFORMER_BASED_WRAP` every module whose class is named in the model's `_no_split_modules` becomes an FSDP
unit (`fully_shard`), then the root; with `NO_WRAP` the root alone. Rank 0 (or the
single process) saves {"losses": the global mean loss of every step, "weights": the full trained weights}.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TINY = {
    "compressive": dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, segment_length=16,
        mem_len=16, c_mem_len=8, compression_rate=2, hidden_dropout=0.0, attention_dropout=0.0,
    ),
    "sinkhorn": dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, bucket_size=8,
        max_position_embeddings=64, causal=True,
    ),
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(TINY), required=True)
    parser.add_argument("--config", nargs="*", default=[], help="extra config fields, KEY=VALUE (Python literals)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="global rows per step")
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--accelerate_config", default="configs/accelerate/fsdp.yaml",
                        help="Accelerate config file whose fsdp_auto_wrap_policy chooses the FSDP units")  # fmt: skip
    parser.add_argument("--packed", action="store_true",
                        help="each row packs documents of 5, 20, 11 and 28 tokens (position_ids restarting), run in "
                        "groups of their own (longrange.packing.GROUP_COST = 0): several forwards per step")  # fmt: skip
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)

    import ast

    from transformers import AutoConfig, AutoModelForCausalLM

    import longrange  # noqa: F401  (registers the model types)
    from longrange import packing

    packing.GROUP_COST = 0
    documents = (5, 20, 11, 28)  # (with --packed; --length 64)

    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    fields = dict(TINY[args.model], vocab_size=256)
    for item in args.config:
        key, _, value = item.partition("=")
        fields[key] = ast.literal_eval(value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(args.model, **fields))
    names = [name for name, _ in model.named_parameters()]
    if distributed:
        from accelerate.commands.config.config_args import load_config_from_file
        from accelerate.utils import FullyShardedDataParallelPlugin
        from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.7: FSDP2 lived under _composable
            from torch.distributed._composable.fsdp import fully_shard

        fsdp_config = load_config_from_file(str(REPO / args.accelerate_config)).fsdp_config
        assert fsdp_config["fsdp_version"] == 2, fsdp_config
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy=fsdp_config["fsdp_auto_wrap_policy"])
        policy = fsdp2_prepare_auto_wrap_policy(plugin, model)  # Accelerate's FSDP2 auto-wrapping
        units = [m for m in model.modules() if policy is not None and policy(m) and m is not model]
        if fsdp_config["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP":  # by the model's `_no_split_modules`
            assert len(units) == model.config.num_hidden_layers, (model._no_split_modules, len(units))
        for unit in units:
            fully_shard(unit)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.randint(0, 256, (args.steps, args.batch, args.length), generator=torch.Generator().manual_seed(1))
    rows = args.batch // world
    losses = []
    model.train()
    for step in range(args.steps):
        ids = data[step, rank * rows : (rank + 1) * rows]
        positions = torch.cat([torch.arange(n) for n in documents]).expand_as(ids) if args.packed else None
        loss = model(input_ids=ids, labels=ids, position_ids=positions).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        if distributed:
            dist.all_reduce(total)
        losses.append(float(total) / world)
    weights = {}
    for name, param in zip(names, model.parameters()):
        full = param.full_tensor() if hasattr(param, "full_tensor") else param  # DTensor shards -> whole tensor
        weights[name] = full.detach().clone()
    if rank == 0:
        torch.save({"losses": losses, "weights": weights, "world": world}, args.out)
    if distributed:
        # both ranks reach the end before the group is torn down: rank 1 tearing gloo down while rank 0 still
        # saved once aborted the process ("terminate called without an active exception", 1 run in many); and
        # the sharded model and optimizer (which hold gloo work handles) go first, while the interpreter is whole:
        # the same abort came back once with the barrier alone (CI, a heavily loaded machine)
        del model, optimizer, loss
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
