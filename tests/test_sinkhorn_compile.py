"""Sinkhorn training on accelerators: no host reads in a training step, one graph for torch.compile (fullgraph,
same numbers as eager), bf16 training, and the attention implementation switch (sdpa / eager)."""

import pytest
import torch

from longrange.configuration_sinkhorn import SinkhornConfig
from longrange.modeling_sinkhorn import SinkhornForCausalLM, SinkhornForMaskedLM
from tests.dispatch_utils import count_dispatched_ops, kernel_ops, needs_traceable_outputs, sync_ops

TINY = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, bucket_size=8)
PKM = dict(pkm_layers=[2], pkm_num_keys=8, pkm_topk=4, pkm_heads=2)

CONFIGS = {
    "causal": dict(causal=True),
    "causal-local-unweighted": dict(causal=True, n_local_attn_heads=1, n_top_buckets=1, weight_routed_values=False),
    "causal-extras": dict(
        causal=True,
        ff_chunks=3,
        ff_glu=True,
        emb_dim=8,
        layer_dropout=0.3,
        attn_dropout=0.1,
        ff_dropout=0.1,
        randomly_truncate_sequence=True,
        **PKM,
    ),
    "causal-context": dict(causal=True, receives_context=True, context_bucket_size=4),
    "causal-reversible": dict(causal=True, reversible=True, layer_dropout=0.3, **PKM),  # layer choice drawn on the CPU
    "masked": dict(n_local_attn_heads=1),
    "sortcut": dict(n_sortcut=2),
    "gumbel-sinkhorn": dict(non_permutative=False, use_simple_sort_net=True, weight_tie=True),
    "masked-context-sortcut": dict(receives_context=True, context_n_sortcut=1),
}


def build(name, seed=0, **overrides):
    options = {**TINY, "max_position_embeddings": 64, **CONFIGS[name], **overrides}
    torch.manual_seed(seed)
    config = SinkhornConfig(**options)
    cls = SinkhornForCausalLM if config.causal else SinkhornForMaskedLM
    return cls(config).train()


def batch(model, batch_size=2, length=30, seed=1):
    """input ids, a padded attention mask (row 1 padded: left for a causal model, right otherwise), labels, and a
    padded context for models that receive one."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 40, (batch_size, length), generator=gen)
    mask = torch.ones(batch_size, length, dtype=torch.long)
    if model.config.causal:
        mask[-1, :5] = 0
    else:
        mask[-1, -5:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    kwargs = dict(input_ids=ids, attention_mask=mask, labels=labels)
    if model.config.receives_context:
        kwargs["encoder_hidden_states"] = torch.randn(batch_size, 11, model.config.hidden_size, generator=gen)
        context_mask = torch.ones(batch_size, 11, dtype=torch.long)
        context_mask[-1, -3:] = 0
        kwargs["encoder_attention_mask"] = context_mask
    return kwargs


def training_step(model, kwargs):
    def step():
        model.zero_grad(set_to_none=True)  # each step creates the gradients (no accumulation into earlier ones)
        model(**kwargs).loss.backward()

    return step


# ---- no host reads ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_training_step_reads_nothing_back_to_the_host(name):
    model = build(name)
    counts = count_dispatched_ops(training_step(model, batch(model)))
    assert counts["aten.mm"] + counts["aten.addmm"] + counts["aten.bmm"] > 0  # the step really ran
    assert sync_ops(counts) == {}


def test_bad_token_ids_still_raise_without_a_host_read():
    model = build("causal")
    counts = count_dispatched_ops(lambda: model(torch.tensor([[1, 2, 3]])))
    assert counts["aten._assert_async"] == 1 and sync_ops(counts) == {}
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, vocab_size=40\)"):
        model(torch.tensor([[1, 2, 40]]))


@pytest.mark.parametrize("name", ["causal", "sortcut"])
def test_operators_per_training_step_do_not_grow_with_batch_or_length(name):
    # (not compared: a batch of one, which launches fewer (gradients of tensors broadcast over the batch need no
    # reduction), and lengths that are multiples of bucket_size (no padding to trim))
    model = build(name)
    counts = [
        sum(kernel_ops(count_dispatched_ops(training_step(model, batch(model, b, n)))).values())
        for b, n in ((2, 26), (5, 26), (3, 62))
    ]
    assert counts[0] == counts[1] == counts[2]


@pytest.mark.parametrize("name", [*CONFIGS, "causal-running-summary"])
def test_training_step_runs_no_cumulative_sum(name):
    # inductor writes a cumulative sum over few long rows as a split scan, which torch 2.11 (not 2.13) cannot
    # generate for a GPU with index arithmetic fused in: compiled Sinkhorn training at 1 x 32,768 tokens failed on
    # an H200. The step's prefix sums are products (`earlier_sums`, `running_sums`), checked against a loop below.
    if name == "causal-running-summary":
        model = build("causal", causal_key_summary="running_mean_sum")
    else:
        model = build(name)
    kwargs = batch(model)
    # (given positions: those from the mask are a cumulative sum over tokens, with nothing fused that fails: the
    # step at 1 x 32,768 with padding generates for a GPU, `benchmarks/count_kernels.py --device cuda`)
    kwargs["position_ids"] = torch.arange(kwargs["input_ids"].shape[1]).expand_as(kwargs["input_ids"])
    counts = count_dispatched_ops(training_step(model, kwargs))
    assert counts["aten.mm"] + counts["aten.addmm"] + counts["aten.bmm"] > 0  # the step really ran
    assert counts["aten.cumsum"] == 0


def test_prefix_sums_as_products_equal_a_loop():
    from longrange.sinkhorn_routing import earlier_sums, running_sums

    x = torch.randn(2, 3, 12, 5, dtype=torch.float64).to(torch.bfloat16)  # bf16 in, float32 out
    exact = x.double()
    earlier = torch.stack([exact[:, :, :i].sum(2) for i in range(12)], dim=2)
    running = torch.stack([exact[:, :, : i + 1].sum(2) for i in range(12)], dim=2)
    assert earlier_sums(x).dtype == running_sums(x, 4).dtype == torch.float32
    torch.testing.assert_close(earlier_sums(x).double(), earlier, rtol=1e-6, atol=1e-6)
    for bucket in (1, 3, 4, 12):
        torch.testing.assert_close(running_sums(x, bucket).double(), running, rtol=1e-6, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # float32 whatever autocast says
        torch.testing.assert_close(earlier_sums(x).double(), earlier, rtol=1e-6, atol=1e-6)


# ---- torch.compile ------------------------------------------------------------------------------------------


@needs_traceable_outputs
@pytest.mark.parametrize("name", ["causal-local-unweighted", "causal-context", "gumbel-sinkhorn"])  # + fullgraph below
def test_training_forward_is_one_graph(name):
    model = build(name, attn_dropout=0.1)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(**batch(model))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()


@needs_traceable_outputs  # (before transformers 5.24 the compiled model's outputs break; the refusal holds)
def test_compiled_forward_refuses_a_sequence_longer_than_the_position_table():
    # (the length is known while tracing; the check used to be skipped whenever compiling, and a compiled forward
    # of 100 tokens with a 64-position table indexed its bucket positions out of range without a word)
    model = build("causal")
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend="eager")
        with pytest.raises(ValueError, match=r"sequence length 100 exceeds max_position_embeddings \(64\)"):
            compiled(input_ids=torch.zeros(1, 100, dtype=torch.long))
        assert compiled(input_ids=torch.zeros(1, 64, dtype=torch.long)).logits.shape == (1, 64, 40)
    finally:
        torch._dynamo.reset()


def loss_and_grads(model, kwargs, run=None):
    """Loss and parameter gradients of one step of `run` (default: the model itself; a compiled wrapper of it)."""
    model.zero_grad()
    loss = (model if run is None else run)(**kwargs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_compiled_equals_eager(name, backend, **overrides):
    model = build(name, **overrides)
    kwargs = batch(model)
    loss, grads = loss_and_grads(model, kwargs)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        compiled_loss, compiled_grads = loss_and_grads(model, kwargs, run=compiled)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(compiled_loss, loss, rtol=1e-5, atol=1e-6)
    assert compiled_grads.keys() == grads.keys() and len(grads) > 10
    for key, grad in grads.items():
        torch.testing.assert_close(compiled_grads[key], grad, rtol=1e-5, atol=1e-5 * grad.abs().max().item())


@needs_traceable_outputs
@pytest.mark.parametrize("name", ["causal", "sortcut"])
def test_fullgraph_compile_traces_forward_and_backward_to_the_eager_numbers(name):
    # aot_eager: the whole forward and backward traced into one graph each (fast to compile); inductor below
    assert_compiled_equals_eager(name, "aot_eager", num_hidden_layers=1)


@needs_traceable_outputs
@pytest.mark.slow
@pytest.mark.parametrize("name", ["causal", "causal-local-unweighted", "sortcut"])  # not Gumbel: inductor's RNG
def test_fullgraph_inductor_compile_gives_the_eager_numbers(name):  # draws other noise than eager's
    assert_compiled_equals_eager(name, "inductor")


# ---- bf16 ---------------------------------------------------------------------------------------------------


def flat_grads(model):
    return torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("name", ["causal-local-unweighted", "causal-context", "sortcut", "gumbel-sinkhorn"])
@pytest.mark.parametrize("mode", ["backward-inside-autocast", "backward-outside-autocast", "bf16-weights"])
def test_bf16_training_step_is_finite_and_close_to_float32(name, mode):
    model = build(name)
    kwargs = batch(model)
    torch.manual_seed(3)
    reference = model(**kwargs).loss
    reference.backward()
    reference_grads = flat_grads(model)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)  # the same Gumbel noise where training draws it
    if mode == "bf16-weights":
        model.to(torch.bfloat16)
        if "encoder_hidden_states" in kwargs:
            kwargs["encoder_hidden_states"] = kwargs["encoder_hidden_states"].bfloat16()
        loss = model(**kwargs).loss
        loss.backward()
        assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters() if p.grad is not None)
    else:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**kwargs).loss
            if mode == "backward-inside-autocast":
                loss.backward()
        if mode == "backward-outside-autocast":
            loss.backward()
    grads = flat_grads(model)
    assert grads.numel() == reference_grads.numel() and torch.isfinite(grads).all()
    torch.testing.assert_close(loss.float(), reference, rtol=2e-2, atol=0)
    cosine = torch.nn.functional.cosine_similarity(grads, reference_grads, dim=0)
    # routing summaries and scores stay float32 under autocast (routing_matmul): with them in bf16 (torch 2.6's CPU
    # autocast) the Gumbel-Sinkhorn case fell to 0.965
    assert cosine > 0.999


# ---- attention implementation ---------------------------------------------------------------------------------


def head_groups(model):
    return [
        group
        for layer in model.model.layers
        for attention in (
            layer.attention.attention,
            getattr(getattr(layer, "cross_attention", None), "attention", None),
        )
        if attention is not None
        for group in getattr(attention, "groups", [getattr(attention, "heads", None)])
    ]


@pytest.mark.parametrize(
    "name", ["causal-local-unweighted", "causal-context", "masked", "sortcut", "masked-context-sortcut"]
)
def test_sdpa_and_eager_give_the_same_logits_and_gradients(name):
    sdpa = build(name)
    eager = build(name, attn_implementation="eager")
    eager.load_state_dict(sdpa.state_dict())
    assert sdpa.config._attn_implementation == "sdpa" and eager.config._attn_implementation == "eager"
    assert {g.implementation for g in head_groups(sdpa)} == {"sdpa"}
    assert {g.implementation for g in head_groups(eager)} == {"eager"}
    kwargs = batch(sdpa)
    results = {}
    for label, model in (("sdpa", sdpa), ("eager", eager)):
        model.eval()  # no dropout, no Gumbel noise: the same numbers expected
        counts = count_dispatched_ops(
            lambda model=model, label=label: results.__setitem__(label, loss_and_grads(model, kwargs))
        )
        fused = sum(n for op, n in counts.items() if "scaled_dot_product" in op)
        assert (fused > 0) == (label == "sdpa")  # each really runs its own kernel
        with torch.no_grad():
            results[label] += (model(**kwargs).logits,)
    (loss, grads, logits), (eager_loss, eager_grads, eager_logits) = results["sdpa"], results["eager"]
    torch.testing.assert_close(eager_logits, logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(eager_loss, loss, rtol=1e-5, atol=1e-6)
    for key, grad in grads.items():
        torch.testing.assert_close(eager_grads[key], grad, rtol=1e-4, atol=1e-5 * grad.abs().max().item())


def test_attn_implementation_from_config_from_pretrained_and_set_attn_implementation(tmp_path):
    from transformers import AutoModelForMaskedLM

    import longrange  # noqa: F401  (registers the Auto classes)

    model = build("masked")
    assert model.config._attn_implementation == "sdpa"  # the default, on every device
    model.save_pretrained(tmp_path)
    loaded = AutoModelForMaskedLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert {g.implementation for g in head_groups(loaded)} == {"eager"}
    loaded.set_attn_implementation("sdpa")
    assert loaded.config._attn_implementation == "sdpa"
    assert {g.implementation for g in head_groups(loaded)} == {"sdpa"}
    configured = AutoModelForMaskedLM.from_config(SinkhornConfig(**TINY, attn_implementation="eager"))
    assert {g.implementation for g in head_groups(configured)} == {"eager"}


@pytest.mark.parametrize("value", ["flex_attention", "flash_attention_2", "paged|eager", "fast"])
def test_unsupported_attn_implementation_names_the_allowed_values(value):
    message = rf"attn_implementation=\"{value}\".*allowed values: 'sdpa', 'eager'"
    with pytest.raises(ValueError, match=message.replace("|", r"\|")):
        SinkhornForCausalLM(SinkhornConfig(**TINY, causal=True, attn_implementation=value))
    model = build("causal")
    with pytest.raises(ValueError, match=message.replace("|", r"\|")):
        model.set_attn_implementation(value)
    assert model.config._attn_implementation == "sdpa"


# ---- fewer launches: the ordinary and shifted causal heads in one pass -------------------------------------------


def test_paired_causal_heads_equal_two_separate_passes_with_fewer_launches():
    from longrange.sinkhorn_attention import SinkhornSelfAttention

    config = SinkhornConfig(**TINY, causal=True, max_position_embeddings=64, attn_implementation="eager")
    torch.manual_seed(5)
    attention = SinkhornSelfAttention(config).double().train()
    for group in attention.groups:
        torch.nn.init.normal_(group.null_keys)
        torch.nn.init.normal_(group.null_values)
    assert attention.runs == [[0, 1]]  # 2 ordinary + 2 shifted heads: one pass
    hidden = torch.randn(2, 29, 16, dtype=torch.float64)
    mask = torch.ones(2, 29, dtype=torch.bool)
    mask[1, :6] = False
    padded = torch.nn.functional.pad(mask, (0, 3))  # to a bucket multiple, as the model does

    def run(runs):
        attention.runs = runs
        attention.zero_grad(set_to_none=True)
        x = torch.nn.functional.pad(hidden, (0, 0, 0, 3)).requires_grad_(True)
        out = attention(x, padded)
        (out[:, :29] * torch.linspace(-1, 1, 16, dtype=torch.float64)).sum().backward()
        return out[:, :29].detach(), x.grad, {n: p.grad.clone() for n, p in attention.named_parameters()}

    counts = {}
    for label, runs in (("paired", [[0, 1]]), ("separate", [[0], [1]])):
        counts[label] = sum(kernel_ops(count_dispatched_ops(lambda runs=runs: run(runs))).values())
    paired, separate = run([[0, 1]]), run([[0], [1]])
    real = mask[..., None].expand(-1, -1, 16)
    torch.testing.assert_close(paired[0][real], separate[0][real], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(paired[1], separate[1], rtol=1e-12, atol=1e-12)
    for name, grad in separate[2].items():  # routing scores run in float32: their gradients agree to float32
        torch.testing.assert_close(paired[2][name], grad, rtol=1e-6, atol=1e-9)
    assert counts["paired"] < 0.7 * counts["separate"]


def test_paired_causal_heads_keep_cached_generation_exact():
    from tests.test_sinkhorn_model import causal_lm, stepwise_logits

    model = causal_lm(seed=6, n_top_buckets=2, num_attention_heads=4)  # no local heads: the paired pass
    assert model.model.layers[0].attention.attention.runs == [[0, 1]]
    ids = torch.randint(0, 40, (2, 35))
    mask = torch.ones(2, 35, dtype=torch.long)
    mask[0, :3] = 0
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
    for prefill in (3, 17):  # the cache filled by the paired pass mid-bucket, then stepped across boundaries
        stepped = stepwise_logits(model, ids, mask, prefill=prefill)
        torch.testing.assert_close(stepped[mask.bool()], full[mask.bool()], rtol=1e-5, atol=1e-5)


# ---- fewer launches: what the head groups derive from the padding mask, once per forward ---------------------------

# (not aten.full: the local heads' zero blocks beside the keys and values of the first window are built per layer)
CONSTANTS = ("aten.arange", "aten.ones", "aten.tril", "aten.eye", "aten.new_ones")


@pytest.mark.parametrize(
    "name, extra",
    [
        ("causal", {}),
        ("causal-local-unweighted", {}),
        ("causal", dict(num_attention_heads=3)),  # odd: ordinary and shifted heads in two passes
        ("causal", dict(shifted_heads_skip_first_bucket=True, causal_key_summary="running_mean_sum")),
        ("masked", {}),
        ("sortcut", {}),
        ("gumbel-sinkhorn", {}),
    ],
)
def test_layers_after_the_first_derive_nothing_from_the_padding_mask(name, extra, monkeypatch):
    """The model hands every layer one BucketMask: bucket counts, candidate masks, additive masks and index
    tensors are computed by the first layer only. Measured against the same model computing them in every layer
    (BucketMask keeping nothing): the same numbers, fewer operators, and no constant built after the first layer."""
    from longrange.sinkhorn_routing import BucketMask

    def forward_counts(layers):
        model = build(name, hidden_size=24 if "num_attention_heads" in extra else 16, **extra, num_hidden_layers=layers)
        kwargs = batch(model)
        model.eval()  # (no dropout, no layer dropout: the same numbers in both runs)
        counts = kernel_ops(count_dispatched_ops(lambda: model(**kwargs)))
        return model(**kwargs).logits, counts

    shared = {layers: forward_counts(layers) for layers in (2, 3)}
    monkeypatch.setattr(BucketMask, "terms", lambda self, key, compute: compute(self.mask))
    per_layer = {layers: forward_counts(layers) for layers in (2, 3)}
    for layers in (2, 3):
        torch.testing.assert_close(shared[layers][0], per_layer[layers][0], rtol=0, atol=0)
    saved = [sum(per_layer[n][1].values()) - sum(shared[n][1].values()) for n in (2, 3)]
    assert 0 < saved[0] < saved[1]  # every layer after the first saves its terms
    built = [sum(shared[n][1][op] for op in CONSTANTS) for n in (2, 3)]
    assert built[0] == built[1]


def test_the_shared_mask_follows_a_model_split_over_devices():
    """Accelerate's hooks (`device_map`) move each layer's inputs with `send_to_device`: the BucketMask answers with
    itself on its own device (its terms kept) and with one copy per other device, whose layers share its terms."""
    from accelerate.utils import send_to_device

    from longrange.sinkhorn_routing import BucketMask

    masks = BucketMask(torch.ones(2, 16, dtype=torch.bool))
    assert send_to_device(masks, torch.device("cpu")) is masks
    moved = send_to_device(masks, "meta")
    assert moved is not masks and moved.mask.device.type == "meta" and moved.mask.shape == (2, 16)
    assert send_to_device(masks, torch.device("meta")) is moved  # the layers on that device share one copy
    built = []
    for holder in (moved, send_to_device(masks, "meta")):
        holder.terms(("k",), lambda m: built.append(m.device) or m.sum())
    assert built == [torch.device("meta")]


def constant_nodes(gm: torch.fx.GraphModule) -> int:
    """The nodes of a dynamo graph that build an index or mask constant (`CONSTANTS`, as torch functions or methods)."""
    names = {op.split(".")[1] for op in CONSTANTS}
    return sum(getattr(node.target, "__name__", str(node.target)) in names for node in gm.graph.nodes)


def recording(graphs: list):
    """A torch.compile backend that runs each dynamo graph as it is and appends it to `graphs`."""

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend


@needs_traceable_outputs
@pytest.mark.parametrize("name", ["causal", "masked"])
def test_compiled_models_share_the_mask_terms_and_compiled_layers_make_one_graph(name):
    """A graph compiled from the whole model keeps the BucketMask's terms like an eager forward (the compiler does
    not merge the layers' copies: each would be a kernel per layer). Layers compiled alone (Accelerate's regional
    compilation), the BucketMask made outside their graph, keep nothing: one graph for every layer, no
    recompilation. Both give the eager numbers."""
    from torch._dynamo.utils import counters

    constants = {}
    for layers in (2, 3):
        model = build(name, num_hidden_layers=layers)
        model.eval()
        kwargs = batch(model)
        graphs = []
        torch._dynamo.reset()
        logits = torch.compile(model, backend=recording(graphs), fullgraph=True)(**kwargs).logits
        torch.testing.assert_close(logits, model(**kwargs).logits, rtol=1e-6, atol=1e-6)
        assert len(graphs) == 1
        constants[layers] = constant_nodes(graphs[0])
    assert constants[2] == constants[3] > 0  # built once, by the first layer
    model = build(name, num_hidden_layers=3)
    kwargs = batch(model)
    expected = loss_and_grads(model, kwargs)
    torch._dynamo.reset()
    counters.clear()
    layers = model.model.layers
    for i, layer in enumerate(layers):  # as `longrange train --compile` has Accelerate do (tests/test_train.py)
        layers[i] = torch.compile(layer, backend="aot_eager", fullgraph=True)
    for _ in range(2):
        loss, grads = loss_and_grads(model, kwargs)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"]
    torch.testing.assert_close(loss, expected[0], rtol=1e-5, atol=1e-6)
    grads = {key.replace("._orig_mod", ""): grad for key, grad in grads.items()}
    assert grads.keys() == expected[1].keys()
    for key, grad in expected[1].items():
        torch.testing.assert_close(grads[key], grad, rtol=1e-4, atol=1e-6, msg=key)
    torch._dynamo.reset()
