"""benchmarks/benchmark_recall.py: the synthetic tasks (checked by reading the sequences back token by token), the
regions of each family's geometry, and a `--quick` run whose cached generate() must agree with the forward."""

from __future__ import annotations

import importlib.util
import json
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "benchmark_recall.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("longrange_benchmark_recall", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_passkey_sequences_read_back(bench):
    batch = bench.passkey(torch.Generator().manual_seed(0), 64, 96)
    for ids, answers, facts in zip(batch.ids.tolist(), batch.answers.tolist(), batch.facts.tolist()):
        assert ids.count(bench.KEY) == 1 and ids.count(bench.QUERY) == 1
        key, query = ids.index(bench.KEY), ids.index(bench.QUERY)
        assert query == 96 - 5 and key + 4 < query
        assert ids[query + 1 :] == ids[key + 1 : key + 5] and all(0 <= d <= 9 for d in ids[key + 1 : key + 5])
        assert answers == [92, 93, 94, 95] and facts == [key + 1, key + 2, key + 3, key + 4]
        others = ids[:key] + ids[key + 5 : query]
        assert all(bench.PASSKEY_FILLER.start <= t < bench.PASSKEY_FILLER.stop for t in others)


def test_mqar_sequences_read_back(bench):
    batch = bench.mqar(torch.Generator().manual_seed(1), 64, 128, pairs=5)
    for ids, answers, facts in zip(batch.ids.tolist(), batch.answers.tolist(), batch.facts.tolist()):
        query = ids.index(bench.QUERY)
        assert query == 128 - 11 and answers == [query + 2 + 2 * i for i in range(5)]
        prefix_keys = [i for i, t in enumerate(ids[:query]) if t in bench.MQAR_KEYS]
        assert len(prefix_keys) == 5 and len({ids[i] for i in prefix_keys}) == 5  # distinct keys, each once
        for answer, fact in zip(answers, facts):
            key = ids[answer - 1]
            (place,) = [i for i in prefix_keys if ids[i] == key]  # where this key was given
            assert fact == place + 1 and ids[answer] == ids[place + 1] and 0 <= ids[answer] <= 9
        assert sorted(ids[a - 1] for a in answers) == sorted(ids[i] for i in prefix_keys)  # every key asked once


def test_regions_follow_the_geometry(bench):
    args = bench.parse_args(
        ["--family", "compressive", "--segment", "32", "--mem", "32", "--c-mem", "8", "--rate", "4"]
    )
    names, region = bench.regions_of("compressive", args)
    t = torch.full((6,), 100)  # predicting token 100: its segment starts at 96
    f = torch.tensor([96, 95, 64, 63, 32, 31])  # own; memory (64..95); compressed (32..63); beyond
    assert [names[i] for i in region(t, f).tolist()] == ["own segment", "memory", "memory", "compressed",
                                                         "compressed", "beyond"]  # fmt: skip
    args = bench.parse_args(["--family", "sinkhorn", "--bucket", "16"])
    names, region = bench.regions_of("sinkhorn", args)
    t, f = torch.full((4,), 40), torch.tensor([32, 31, 16, 15])  # bucket 2 starts at 32
    assert [names[i] for i in region(t, f).tolist()] == ["own bucket", "previous bucket", "previous bucket", "routed"]


def test_rate_variants_keep_the_slots_and_the_reach(bench):
    args = bench.parse_args(["--family", "compressive"])  # 32 memories + 32 compressed at rate 4
    specs = bench.family_specs("compressive", args)
    slots_reach = {}
    for name in ("compressive", "compressive_rate3", "compressive_rate5"):
        o = specs[name].options
        slots_reach[name] = (o["mem_len"] + o["c_mem_len"], o["mem_len"] + o["c_mem_len"] * o["compression_rate"])
    assert slots_reach == dict.fromkeys(slots_reach, (64, 160))
    assert specs["compressive_rate3"].options["compression_rate"] == 3
    assert specs["compressive_rate5"].options["compression_rate"] == 5
    args = bench.parse_args(["--family", "compressive", "--mem", "8", "--c-mem", "5", "--rate", "4"])
    assert "compressive_rate3" not in bench.family_specs("compressive", args)  # 15 / 2 compressed: not whole


def test_bad_arguments_name_the_option(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--family", "sinkhorn", "--models", "compressive"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--family", "compressive", "--length", "100"])  # not a segment multiple
    with pytest.raises(ValueError, match="--pairs"):
        bench.mqar(torch.Generator(), 1, 64, pairs=30)


@pytest.mark.parametrize("family", ["compressive", "sinkhorn"])
def test_quick_run_records_and_cached_generation_agrees(bench, tmp_path, family):
    out, image = tmp_path / "recall.json", tmp_path / "recall.png"
    bench.main(["--quick", "--family", family, "--no-progress", "--json", str(out), "--plot", str(image)])
    record = json.loads(out.read_text())
    runs = record["runs"]
    assert {run["model"] for run in runs.values()} == {bench.DEFAULT_MODELS[family][0], "llama"}
    for run in runs.values():
        assert set(run["accuracy"]) == set(bench.regions_of(family, bench.parse_args(["--family", family]))[0])
        assert sum(run["count"].values()) == 16 * 4  # every answer digit of the evaluation set is scored once
        # every generated digit is the argmax of an uncached forward over the same tokens: the cache carried them
        assert run["gen_agree"] == 1.0 and run["gen_agree_all"] == 1.0
        assert run["curve"] and run["train_seconds"] >= 0
    ours = runs[f"{family}|passkey|{160 if family == 'compressive' else 256}|{bench.DEFAULT_MODELS[family][0]}|0"]
    if family == "sinkhorn":
        assert 0 <= ours["pick_rate"] <= 1 and ours["pick_chance"] > 0
        assert ours["any_picked"] is not None and 0 <= ours["any_picked"] <= 1
    assert image.stat().st_size > 0 and record["versions"]["torch"] == version("torch")
    assert not bench.variants_path(image).exists()  # only the main set ran


def test_pick_counts_split_accuracy_by_whether_the_fact_bucket_was_picked(bench):
    from types import SimpleNamespace

    args = bench.parse_args(["--family", "sinkhorn", "--bucket", "16"])
    _, region = bench.regions_of("sinkhorn", args)
    config = SimpleNamespace(n_local_attn_heads=1, bucket_size=16, causal=True, n_top_buckets=2, n_sortcut=0)
    predicting = torch.tensor([[100], [100], [100], [100]])  # query bucket 6
    facts = torch.tensor([[10], [20], [90], [50]])  # buckets 0 and 1 (routed), 5 (previous: not counted), 3 (routed)
    picks = torch.full((4, 3, 8, 2), -1)  # [rows, heads, query buckets, n_top]; head 0 is local
    picks[0, 0, 6] = torch.tensor([0, 1])  # a local head "picking" is ignored
    picks[1, 1, 6, 0] = 1  # row 1: the fact's bucket, by head 1
    picks[3, 2, 6, 1] = 3  # row 3: by head 2
    layer = SimpleNamespace(offsets=torch.zeros(3, dtype=torch.long), key_buckets=picks)
    correct = torch.tensor([[False], [True], [True], [False]])
    out = {"regions": {}, "bins": []}
    bench.count_picks(out, [layer, layer], config, predicting, facts, region, correct)
    assert out["picks"][:2] == [4, 12]  # rows 0, 1, 3 x 2 Sinkhorn heads x 2 layers; row 1 and 3 hit once per layer
    assert out["acc_picked"] == [1, 2] and out["acc_missed"] == [0, 1]  # row 1 right, row 3 wrong; row 0 wrong


def test_curriculum_keeps_facts_near_and_grows(bench):
    args = bench.parse_args(["--family", "sinkhorn", "--curriculum", "100"])
    assert bench.curriculum_reach(0, args) == 16 and bench.curriculum_reach(50, args) == 16 + 120
    assert bench.curriculum_reach(100, args) is None and bench.record_name("top2", args) == "top2+curriculum100"
    longer = bench.parse_args(["--family", "sinkhorn", "--curriculum", "100", "--steps", "4000"])
    assert bench.record_name("top2", longer) == "top2+curriculum100+steps4000"
    slower = bench.parse_args(["--family", "sinkhorn", "--steps", "6000", "--lr", "5e-4"])
    assert bench.record_name("top2", slower) == "top2+steps6000+lr0.0005"
    batch = bench.passkey(torch.Generator().manual_seed(0), 256, 256, max_back=40)
    query = 256 - 5
    assert ((query - batch.facts[:, 0] + 1) <= 40).all() and batch.facts[:, 0].min() < query - 30
    batch = bench.mqar(torch.Generator().manual_seed(0), 64, 256, pairs=4, max_back=24)
    query = 256 - 9  # QUERY, then 4 keys and values
    assert ((query - batch.facts) <= 24).all() and (batch.facts < query).all()


@pytest.mark.parametrize("width", [["--heads", "4"], ["--hidden", "48", "--heads", "3"]])  # paired / lone groups
def test_oracle_routing_picks_the_fact_buckets_and_leaves_the_model_alone(bench, width):
    from longrange.sinkhorn_heads import CausalSinkhornHeads

    args = bench.parse_args(["--family", "sinkhorn", "--length", "128", "--layers", "1", *width])
    spec = bench.family_specs("sinkhorn", args)["top2_oracle"]
    torch.manual_seed(0)
    model = bench.build(spec, args).eval()
    batch = bench.passkey(torch.Generator().manual_seed(3), 8, 128)
    original = CausalSinkhornHeads._select
    with torch.no_grad(), bench.oracle_routing(model, batch.facts, bench.oracle_on(spec)):
        routing = model(input_ids=batch.ids, use_cache=False, output_attentions=True).routing[0]
    assert CausalSinkhornHeads._select is original
    for head, offset in enumerate(routing.offsets.tolist()):  # every head of every query bucket after the facts
        fact_buckets = (batch.facts + offset) // 16  # [b, 4]
        for row in range(8):
            for u in range(int(fact_buckets[row].max()) + 1, (127 + offset) // 16 + 1):  # to the last token's
                picked = set(routing.key_buckets[row, head, u].tolist())
                assert set(fact_buckets[row].tolist()) <= picked, (head, row, u)
    with torch.no_grad():  # outside the context the sort net chooses as it likes
        free = model(input_ids=batch.ids, use_cache=False, output_attentions=True).routing[0]
    assert not torch.equal(free.key_buckets, routing.key_buckets)


def test_oracle_for_the_first_steps_only_evaluates_the_learned_routing(bench):
    specs = bench.family_specs("sinkhorn", bench.parse_args(["--family", "sinkhorn"]))
    warm = specs["top2_unweighted_local2_oracle1000"]
    assert [bench.oracle_on(warm, s) for s in (0, 999, 1000)] == [True, True, False] and not bench.oracle_on(warm)
    assert bench.oracle_on(specs["top2_oracle"]) and bench.oracle_on(specs["top2_oracle"], 5000)
    assert not bench.oracle_on(specs["top2_unweighted"], 0)


def test_pick_curves_show_the_picked_share_where_recorded(bench):
    def point(step, pick, share=None):
        p = {"step": step, "accuracy": {"own bucket": 1.0, "routed": 0.5}, "pick_rate": pick}
        return p if share is None else {**p, "any_picked": share}

    older = {"seed": 0, "accuracy": {"own bucket": 1.0, "routed": 0.5}, "curve": [point(250, 0.25)]}
    newer = {"seed": 1, "accuracy": older["accuracy"], "curve": [point(250, 0.125, 0.75), point(500, 0.5, 1.0)]}
    rows = bench.pick_curves({"top2": [older, newer], "llama": [{"seed": 0, "curve": [{"step": 250}]}]})
    assert rows[1] == "| model, seed | step 250 | step 500 |" and len(rows) == 5  # every budget's steps; no llama
    assert rows[3] == "| top2, 0 | 0.25 / 0.50 |  |"
    assert rows[4] == "| top2, 1 | 0.12 (0.75) / 0.50 | 0.50 (1.00) / 0.50 |"
    pushed = dict(newer, curve=[{**point(250, 0.5), "push_picked": 0.625, "push_missed": None}])
    rows = bench.pick_curves({"top2": [older, pushed]})
    assert rows[-4].startswith("\nshare of the fact's bucket's routing scores") and rows[-1] == "| top2, 1 | 0.62 / - |"


def test_plot_panels_keep_variants_apart_with_their_references(bench):
    def run(model, task="passkey"):
        return {"family": "sinkhorn", "task": task, "length": 256, "model": model}

    names = ["top1", "llama", "top2", "top2_oracle", "top2_unweighted", "top2_unweighted+steps4000", "gpt2"]
    record = {"runs": {str(i): run(m) for i, m in enumerate(names)} | {"m": run("top2", "mqar")}}
    got = [(key[1], kind, models) for key, kind, models in bench.plot_panels(record)]
    assert got == [
        ("passkey", "main set", ["top1", "top2", "llama"]),
        ("passkey", "variants", ["top2", "llama", "gpt2", "top2_unweighted"]),  # others by name
        ("passkey", "perfect routing (diagnostic)", ["top2", "llama", "top2_oracle"]),
        ("passkey", "longer training", ["top2", "llama", "top2_unweighted", "top2_unweighted+steps4000"]),
        ("mqar", "main set", ["top2"]),
    ]


def test_routing_push_reads_the_buckets_the_evaluation_counts(bench):
    from longrange.sinkhorn_heads import CausalSinkhornHeads

    args = bench.parse_args(["--family", "sinkhorn", "--length", "128", "--layers", "1"])
    specs = bench.family_specs("sinkhorn", args)
    batch = bench.passkey(torch.Generator().manual_seed(3), 16, 128)
    original = CausalSinkhornHeads._select
    pushed = {}
    for name in ("top2_unweighted_rowpos_attngrad", "top2_oracle"):
        torch.manual_seed(0)
        model = bench.build(specs[name], args)
        evaluated = bench.evaluate(specs[name], model, batch, args, "sinkhorn")
        pushed[name] = bench.routing_push(specs[name], model, batch, args, "sinkhorn", step=0)
        # the same picks as the evaluation's routing output, from the scores the gradient is taken of
        assert pushed[name]["pick_rate"] == evaluated["pick_rate"]
        assert all(p.grad is None for p in model.parameters()) and CausalSinkhornHeads._select is original
    learned = pushed["top2_unweighted_rowpos_attngrad"]
    assert 0 <= learned["push_picked"] <= 1 and 0 <= learned["push_missed"] <= 1
    oracle = pushed["top2_oracle"]  # every head picks the fact's bucket: nothing is missed
    assert oracle["pick_rate"] == 1.0 and oracle["push_missed"] is None and 0 <= oracle["push_picked"] <= 1


def test_frozen_routing_attends_what_the_frozen_copy_chooses(bench):
    import copy

    args = bench.parse_args(["--family", "sinkhorn", "--length", "128", "--layers", "2"])
    spec = bench.family_specs("sinkhorn", args)["top2_unweighted_rowpos_frozen2500"]
    torch.manual_seed(0)
    model = bench.build(spec, args)
    batch = bench.passkey(torch.Generator().manual_seed(3), 8, 128)

    def routing(m, frozen=True):
        context = bench.frozen_routing(m, batch.ids) if frozen else torch.no_grad()
        with torch.no_grad(), context:
            return [r.key_buckets for r in m(input_ids=batch.ids, use_cache=False, output_attentions=True).routing]

    before = routing(model)  # no copy yet: the model's own routing
    model.__dict__["frozen_router"] = copy.deepcopy(model).eval().requires_grad_(False)
    with torch.no_grad():  # the attention trains on: its queries and keys move
        for layer in model.model.layers:
            layer.attention.attention.to_q.weight.add_(torch.randn_like(layer.attention.attention.to_q.weight))
    moved = routing(model, frozen=False)
    assert any(not torch.equal(a, b) for a, b in zip(before, moved))
    assert all(torch.equal(a, b) for a, b in zip(before, routing(model)))  # inside: the frozen copy's choice
    bench.training_loss(spec, model, batch, step=3000).backward()
    assert model.lm_head.weight.grad is not None
    assert all(p.grad is None for p in model.__dict__["frozen_router"].parameters())
    assert spec.freeze_routing_at == 2500 and "frozen_router" not in dict(model.named_modules())
    # the routing gradient still reaches the model's scores at the frozen picks, unless detached
    assert bench.routing_push(spec, model, batch, args, "sinkhorn", step=3000)["push_missed"] is not None
    detached = bench.family_specs("sinkhorn", args)["top2_unweighted_rowpos_frozen2500_detached"]
    pushed = bench.routing_push(detached, model, batch, args, "sinkhorn", step=3000)
    assert pushed["push_picked"] is None and pushed["push_missed"] is None
