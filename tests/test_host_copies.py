"""No tensor is made from host data on the model's device in the paths a GPU runs every step.

On an accelerator, `torch.tensor(value, device=...)` (and `torch.as_tensor`, `Tensor.new_tensor`) copies from the
host and waits for every queued kernel to finish first (pytorch/pytorch#120996): one such copy inside an attention
call stalls each layer of each training and decoding step, which a CPU never shows. The test records every such
call in the package's code while both models run what a GPU runs: a training step (forward with padding, the
Compressive model's memories and attention-reconstruction loss, backward), a prefill and decoding steps of
generate(). The Compressive attention kernel is chosen as on a GPU ("sdpa" through `attend`, not the CPU's
blockwise kernel) and the Sinkhorn cache steps as on a GPU (static steps, nothing read back).
"""

from __future__ import annotations

import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

from longrange import CompressiveConfig, CompressiveForCausalLM, SinkhornConfig, SinkhornForCausalLM
from longrange.cache_sinkhorn import SinkhornCache
from longrange.compat import CACHE_NAME

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: tiny tensors, one thread

VOCAB = 40
FACTORIES = (torch.tensor, torch.as_tensor, torch.Tensor.new_tensor)


class HostCopies(TorchFunctionMode):
    """Records where the package makes a tensor of host data on a device (`device=` given, or `new_tensor`,
    which takes its tensor's device)."""

    def __init__(self):
        super().__init__()
        self.sites: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and (func is torch.Tensor.new_tensor or kwargs.get("device") is not None):
            frames = [f for f in traceback.extract_stack()[:-1] if "/longrange/" in f.filename]
            if frames:
                self.sites.append(f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno} {frames[-1].line}")
        return func(*args, **kwargs)


def left_padded(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, length), generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, :3] = 0  # the first row starts later
    return ids, mask


def compressive() -> CompressiveForCausalLM:
    torch.manual_seed(0)
    config = CompressiveConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        segment_length=4, mem_len=4, c_mem_len=2, compression_rate=2,
    )  # fmt: skip
    return CompressiveForCausalLM(config)


def sinkhorn() -> SinkhornForCausalLM:
    torch.manual_seed(0)
    config = SinkhornConfig(
        vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, bucket_size=4, causal=True,
        max_position_embeddings=64, n_local_attn_heads=1, n_top_buckets=2,
    )  # fmt: skip
    return SinkhornForCausalLM(config)


def run_hot_paths(model, cache=None) -> list[str]:
    """A training step and a generate() call under `HostCopies`: the recorded sites."""
    ids, mask = left_padded(2, 16, seed=1)
    recorder = HostCopies()
    with recorder:
        model.train()
        loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        model.eval()
        kwargs = {} if cache is None else {CACHE_NAME: cache}
        model.generate(ids[:, :9], attention_mask=mask[:, :9], max_new_tokens=6, do_sample=False, pad_token_id=0,
                       **kwargs)  # fmt: skip
    return recorder.sites


def test_the_recorder_finds_a_host_copy_in_the_package_and_nowhere_else():
    recorder = HostCopies()
    with recorder:
        torch.tensor(1.0, device="cpu")  # this file's own call: not the package's code
    assert recorder.sites == []
    model = sinkhorn().eval()
    ids, mask = left_padded(2, 16, seed=1)
    with recorder, torch.no_grad():  # output_attentions gathers the heads' bucket offsets from a Python list
        model(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert any(site.startswith("sinkhorn_attention.py:") for site in recorder.sites), recorder.sites


def test_compressive_training_and_decoding_make_no_host_copy(gpu_kernels):
    assert run_hot_paths(compressive()) == []


def test_sinkhorn_training_and_static_decoding_make_no_host_copy():
    model = sinkhorn()
    cache = SinkhornCache(model.config, max_cache_len=32, static_steps=True)  # the steps a GPU runs
    assert run_hot_paths(model, cache) == []
