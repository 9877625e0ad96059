"""Fully sharded data parallel (FSDP2, `fully_shard`) on CPU processes joined by gloo.

Accelerate selects FSDP only on accelerators, so these tests shard the models with torch's `fully_shard` directly,
with the units that Accelerate's FSDP2 auto-wrapping picks from our config files (`tests/fsdp_worker.py`): two processes, each training on its half of
every batch, must follow the loss trajectory of one process training on whole batches, and end with its weights.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "tests" / "fsdp_worker.py"


def subprocess_env() -> dict:
    """Read when a test runs (after tests/conftest.py put the read guard on PYTHONPATH): the repository first."""
    pythonpath = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath, "HF_HUB_OFFLINE": "1"}


def train(out: Path, *args: str, processes: int = 1) -> subprocess.CompletedProcess:
    launch = [sys.executable] if processes == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
    ]  # fmt: skip
    return subprocess.run([*launch, str(WORKER), *args, "--out", str(out)], env=subprocess_env(), capture_output=True, text=True,
                          timeout=600)  # fmt: skip


def assert_same_training(one: Path, two: Path) -> None:
    a, b = torch.load(one, weights_only=False), torch.load(two, weights_only=False)
    assert a["world"] == 1 and b["world"] == 2
    assert len(a["losses"]) == 3
    torch.testing.assert_close(b["losses"], a["losses"], rtol=1e-5, atol=0)
    assert a["weights"].keys() == b["weights"].keys()
    for name in a["weights"]:
        torch.testing.assert_close(b["weights"][name], a["weights"][name], rtol=0, atol=2e-5, msg=name)
    # the check can fail: training moved the weights (the losses differ from step to step)
    assert len(set(a["losses"])) == 3


@pytest.mark.slow  # two process launches per case: ~30 s each on a loaded 2-core machine
@pytest.mark.parametrize(
    "model,accelerate_config,config",
    [
        ("sinkhorn", "fsdp.yaml", []),  # each SinkhornLayer (`_no_split_modules`) one FSDP unit, then the root
        ("sinkhorn", "fsdp_root.yaml", ["reversible=True"]),  # reversible layers: the root as the one unit
        ("compressive", "fsdp.yaml", []),  # each CompressiveDecoderLayer one unit (its FSDP forward methods)
        ("compressive", "fsdp_root.yaml", []),  # the root as the one unit
        # packed documents in groups: each unit runs several forwards before one backward
        ("sinkhorn", "fsdp.yaml", ["--packed"]),
        ("compressive", "fsdp.yaml", ["--packed"]),
    ],
    ids=["sinkhorn", "sinkhorn-reversible", "compressive", "compressive-root", "sinkhorn-packed", "compressive-packed"],
)
def test_two_fsdp_processes_train_like_one_process(tmp_path, model, accelerate_config, config):
    packed = [option for option in config if option.startswith("--")]
    common = ["--model", model, *packed, "--config", *[field for field in config if field not in packed]]
    one = train(tmp_path / "one.pt", *common)
    assert one.returncode == 0, one.stderr[-3000:]
    two = train(tmp_path / "two.pt", *common, "--accelerate_config", f"configs/accelerate/{accelerate_config}",
                processes=2)  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    assert_same_training(tmp_path / "one.pt", tmp_path / "two.pt")


@pytest.mark.parametrize("name", ["ddp.yaml", "fsdp.yaml", "fsdp_root.yaml"])
def test_accelerate_config_files_load(name):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DistributedType

    config = load_config_from_file(str(REPO / "configs" / "accelerate" / name))
    assert config.num_processes == 2 and config.mixed_precision == "no"
    if name == "ddp.yaml":
        assert config.distributed_type == DistributedType.MULTI_GPU
    else:
        assert config.distributed_type == DistributedType.FSDP and config.fsdp_config["fsdp_version"] == 2


# FSDP2 on CPU processes (gloo) needs torch >= 2.7 (2.6 fails on CPU streams: 'Stream' has no 'record_event')
needs_cpu_fsdp2 = pytest.mark.skipif(
    tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 7),
    reason="FSDP2 on CPU processes needs torch >= 2.7",
)


@needs_cpu_fsdp2
def test_reversible_layers_refuse_per_layer_fsdp_units_clearly(tmp_path):
    import torch.distributed as dist

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.7: FSDP2 lived under _composable
        from torch.distributed._composable.fsdp import fully_shard

    from longrange import SinkhornConfig, SinkhornForCausalLM

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        config = SinkhornConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                bucket_size=4, max_position_embeddings=16, causal=True, reversible=True)  # fmt: skip
        model = SinkhornForCausalLM(config)
        units = [m for m in model.modules() if type(m).__name__ in model._no_split_modules]
        assert len(units) == 2
        for unit in units:
            fully_shard(unit)
        fully_shard(model)
        ids = torch.randint(0, 64, (1, 16))
        with pytest.raises(RuntimeError, match="reversible layers cannot run on sharded parameters"):
            model(input_ids=ids, labels=ids)
    finally:
        dist.destroy_process_group()
