"""weight_routed_values (default True): the chosen buckets' values are scaled by their routing weight, in every
code path; False gives plain attention over the chosen buckets."""

import torch

from longrange import SinkhornConfig, SinkhornForCausalLM, SinkhornForMaskedLM

TINY = dict(vocab_size=40, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, bucket_size=4)


def test_weighted_routing_changes_outputs_and_generation_cache_matches_recompute():
    torch.manual_seed(3)
    config = SinkhornConfig(
        **TINY,
        causal=True,
        receives_context=True,
        context_bucket_size=4,
        n_local_attn_heads=1,
        n_top_buckets=1,
        weight_routed_values=False,
    )
    plain = SinkhornForCausalLM(config).eval()
    config_w = SinkhornConfig(**{**config.to_dict(), "weight_routed_values": True})
    model = SinkhornForCausalLM(config_w).eval()
    model.load_state_dict(plain.state_dict())
    ids, context = torch.randint(0, 40, (2, 27)), torch.randn(2, 14, 24)
    kw = dict(encoder_hidden_states=context)
    with torch.no_grad():
        full = model(ids, use_cache=False, **kw).logits
        # a routing weight below 1 on the chosen buckets (one candidate among several) changes the result
        assert (full - plain(ids, use_cache=False, **kw).logits).abs().max() > 1e-4
        out = model(ids[:, :6], use_cache=True, **kw)  # prefill: weights recorded by the full pass
        logits = [out.logits]
        for t in range(6, 27):  # then token by token: weights from the cached routing state
            out = model(ids[:, t : t + 1], cache=out.cache, use_cache=True, **kw)
            logits.append(out.logits)
    torch.testing.assert_close(torch.cat(logits, 1), full, rtol=1e-5, atol=1e-5)


def test_weighted_routing_non_causal_paths():
    torch.manual_seed(4)
    ids = torch.randint(0, 40, (2, 16))
    for extra in (dict(), dict(non_permutative=False), dict(n_sortcut=1)):
        plain = SinkhornForMaskedLM(SinkhornConfig(**TINY, n_top_buckets=1, weight_routed_values=False, **extra))
        plain.eval()
        model = SinkhornForMaskedLM(SinkhornConfig(**TINY, weight_routed_values=True, n_top_buckets=1, **extra))
        model.load_state_dict(plain.state_dict())
        with torch.no_grad():
            difference = (model.eval()(ids).logits - plain(ids).logits).abs().max()
        assert difference > 1e-4, extra
        model.train()
        loss = model(ids, labels=ids).loss
        loss.backward()
        assert torch.isfinite(loss), extra
