"""Sinkhorn: encoder-decoder through transformers.EncoderDecoderModel, save/load, trust_remote_code loading."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, EncoderDecoderConfig, EncoderDecoderModel

import longrange  # noqa: F401  (registers the Auto classes)
from longrange.configuration_sinkhorn import SinkhornConfig
from longrange.modeling_sinkhorn import SinkhornForCausalLM, SinkhornForMaskedLM, SinkhornModel

TINY = dict(vocab_size=40, hidden_size=24, num_hidden_layers=1, num_attention_heads=4, bucket_size=8)


def test_encoder_decoder_trains_and_generates_with_cache():
    torch.manual_seed(0)
    encoder = SinkhornConfig(**TINY)
    decoder = SinkhornConfig(**TINY, context_bucket_size=4, context_n_sortcut=2)
    config = EncoderDecoderConfig.from_encoder_decoder_configs(
        encoder, decoder
    )  # sets is_decoder / add_cross_attention
    config.decoder_start_token_id, config.pad_token_id = 1, 0
    model = EncoderDecoderModel(config=config)
    assert isinstance(model.encoder, SinkhornModel) and isinstance(model.decoder, SinkhornForCausalLM)
    assert model.decoder.config.causal and model.decoder.config.receives_context
    src, tgt = torch.randint(2, 40, (3, 21)), torch.randint(2, 40, (3, 13))
    src_mask = torch.ones_like(src)
    src_mask[0, 15:] = 0
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = model(input_ids=src, attention_mask=src_mask, labels=tgt).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.2
    model.eval()
    kwargs = dict(attention_mask=src_mask, max_new_tokens=12, do_sample=False)
    cached = model.generate(src, **kwargs)
    uncached = model.generate(src, use_cache=False, **kwargs)
    assert cached.shape == (3, 13)
    assert torch.equal(cached, uncached)


def test_decoder_cached_cross_attention_equals_full_recompute():
    torch.manual_seed(1)
    config = SinkhornConfig(**TINY, causal=True, receives_context=True, context_bucket_size=4, n_local_attn_heads=1)
    model = SinkhornForCausalLM(config).eval()
    ids, context = torch.randint(0, 40, (2, 27)), torch.randn(2, 14, 24)
    context_mask = torch.ones(2, 14, dtype=torch.long)
    context_mask[1, 9:] = 0
    kw = dict(encoder_hidden_states=context, encoder_attention_mask=context_mask)
    with torch.no_grad():
        full = model(ids, use_cache=False, **kw).logits
        out = model(ids[:, :4], use_cache=True, **kw)
        logits = [out.logits]
        for t in range(4, 27):
            out = model(ids[:, t : t + 1], cache=out.cache, use_cache=True, **kw)
            logits.append(out.logits)
    torch.testing.assert_close(torch.cat(logits, 1), full, rtol=1e-5, atol=1e-5)


def test_save_and_load_roundtrip_with_auto_classes(tmp_path):
    torch.manual_seed(2)
    config = SinkhornConfig(
        **TINY, causal=True, pkm_layers=[1], pkm_num_keys=8, pkm_topk=4, emb_dim=12, tie_word_embeddings=True
    )
    model = SinkhornForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is SinkhornForCausalLM
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()  # tied
    ids = torch.randint(0, 40, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    mlm = SinkhornForMaskedLM(SinkhornConfig(**TINY, n_sortcut=1)).eval()
    mlm.save_pretrained(tmp_path / "mlm")
    again = AutoModelForMaskedLM.from_pretrained(tmp_path / "mlm").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, mlm(ids).logits, rtol=0, atol=0)


def test_trust_remote_code_loads_from_a_fresh_folder_without_the_package(tmp_path):
    torch.manual_seed(3)
    config = SinkhornConfig(**TINY, causal=True, reversible=True, pkm_layers=[1], pkm_num_keys=8, pkm_topk=4)
    model = SinkhornForCausalLM(config).eval()
    folder = tmp_path / "saved"
    model.save_pretrained(folder)
    for name in (
        "modeling_sinkhorn.py",
        "sinkhorn_heads.py",
        "cache_sinkhorn.py",
        "configuration_sinkhorn.py",
        "layers.py",
        "reversible.py",
    ):
        assert (folder / name).exists(), name
    ids = torch.randint(0, 40, (1, 19))
    with torch.no_grad():
        expected = {"ids": ids, "logits": model(ids).logits, "hidden": model.model(ids).last_hidden_state}
        torch.save(expected, tmp_path / "expected.pt")
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["longrange"] = None  # the package must not be importable
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        expected = torch.load({str(tmp_path / "expected.pt")!r})
        with torch.no_grad():
            logits = model(expected["ids"]).logits
            torch.testing.assert_close(logits, expected["logits"], rtol=0, atol=0)
            out = model.generate(expected["ids"], max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert out.shape == (1, 23)
        # every Auto class of the model type, as for a Llama folder: the base model (feature extraction) ...
        from transformers import AutoModel, AutoModelForMaskedLM
        base = AutoModel.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
        with torch.no_grad():
            torch.testing.assert_close(base(expected["ids"]).last_hidden_state, expected["hidden"], rtol=0, atol=0)
        try:  # ... and the other head, refused naming the class to use
            AutoModelForMaskedLM.from_pretrained({str(folder)!r}, trust_remote_code=True)
            raise SystemExit("a causal folder loaded as the masked LM")
        except ValueError as err:
            assert "use SinkhornForCausalLM" in str(err), err
        print("OK")
        """
    )
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.environ.get("LONGRANGE_READ_GUARD_DIR", "")  # the read guard only: not the repository
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "OK" in result.stdout


def test_a_language_model_class_of_the_wrong_direction_names_the_right_one():
    for causal, wrong, right in (
        (False, SinkhornForCausalLM, "SinkhornForMaskedLM"),
        (True, SinkhornForMaskedLM, "SinkhornForCausalLM"),
    ):
        config = SinkhornConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                bucket_size=4, max_position_embeddings=16, causal=causal)  # fmt: skip
        with pytest.raises(ValueError, match=f"needs causal={not causal} \\(use {right} for causal={causal}\\)"):
            wrong(config)
