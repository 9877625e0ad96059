"""Config edges: `--config KEY=VALUE` refuses keys the model's config does not define; `pkm_topk` follows
`pkm_num_keys` unless set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from longrange import CompressiveConfig, CompressiveForCausalLM, SinkhornConfig, SinkhornForCausalLM
from longrange.product_key_memory import ProductKeyMemory
from longrange.tokenization import byte_tokenizer
from longrange.training import config_keys, parse_config_overrides

REPO = Path(__file__).resolve().parents[1]


def load_train_script():
    from longrange.commands import train

    return train


# ---- --config KEY=VALUE ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config_class", [CompressiveConfig, SinkhornConfig])
def test_unknown_key_is_refused_naming_it_and_listing_the_valid_keys(config_class):
    with pytest.raises(ValueError) as err:
        parse_config_overrides(["hidden_size=64", "no_such_option=1"], config_class)
    message = str(err.value)
    assert "'no_such_option'" in message and config_class.__name__ in message
    for key in ("hidden_size", "num_hidden_layers", "pkm_topk", "vocab_size"):
        assert key in message
    # generic PreTrainedConfig fields are not model options
    with pytest.raises(ValueError, match="'output_hidden_states'"):
        parse_config_overrides(["output_hidden_states=True"], config_class)


def test_valid_keys_are_the_fields_and_their_aliases():
    compressive = config_keys(CompressiveConfig)
    assert compressive["segment_length"] == "segment_length" and compressive["d_model"] == "hidden_size"
    assert "bucket_size" not in compressive and "dtype" not in compressive
    sinkhorn = config_keys(SinkhornConfig)
    assert sinkhorn["temperature"] == "sort_temperature" and sinkhorn["is_decoder"] == "causal"
    assert "segment_length" not in sinkhorn
    for config_class, keys in ((CompressiveConfig, compressive), (SinkhornConfig, sinkhorn)):
        defaults = config_class()
        assert all(hasattr(defaults, field) for field in keys.values())
        assert set(config_class.attribute_map) <= set(keys)


def test_aliases_resolve_to_fields_and_values_are_python_literals():
    parsed = parse_config_overrides(
        ["d_model=64", "n_layers=2", "heads=4", "pkm_layers=[2]", "compression_function=max_pool",
         "reconstruction_loss=none", "hidden_dropout=0.1", "tie_word_embeddings=True", "pad_token_id=None"],
        CompressiveConfig,
    )  # fmt: skip
    assert parsed == {
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "pkm_layers": [2],
        "compression_function": "max_pool", "reconstruction_loss": "none", "hidden_dropout": 0.1,
        "tie_word_embeddings": True, "pad_token_id": None,
    }  # fmt: skip
    config = CompressiveConfig(**parsed)
    assert (config.hidden_size, config.num_hidden_layers, config.pkm_layers) == (64, 2, [2])
    parsed = parse_config_overrides(
        ["dim=32", "depth=3", "max_seq_len=128", "temperature=0.5", "is_decoder=True"], SinkhornConfig
    )
    assert parsed == {"hidden_size": 32, "num_hidden_layers": 3, "max_position_embeddings": 128,
                      "sort_temperature": 0.5, "causal": True}  # fmt: skip
    assert SinkhornConfig(**parsed).sort_temperature == 0.5


def test_malformed_items_and_a_field_given_twice_are_refused():
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_config_overrides(["hidden_size"], CompressiveConfig)
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_config_overrides(["=3"], CompressiveConfig)
    with pytest.raises(ValueError, match="hidden_size is given twice"):
        parse_config_overrides(["hidden_size=32", "d_model=64"], CompressiveConfig)


def test_train_script_refuses_a_typo_and_an_alias_overrides_the_small_default(capsys):
    train = load_train_script()
    with pytest.raises(SystemExit) as exit_info:
        train.parse_args(["--model", "sinkhorn", "--config", "bucket_sise=16"])
    assert exit_info.value.code == 2
    assert "'bucket_sise'" in capsys.readouterr().err
    args = train.parse_args(["--model", "sinkhorn", "--config", "dim=64", "depth=2"])
    assert args.config == {"hidden_size": 64, "num_hidden_layers": 2}
    config = train.build_config(args, byte_tokenizer())
    assert (config.hidden_size, config.num_hidden_layers) == (64, 2)  # not the small config's 128 and 3
    assert config.bucket_size == train.SMALL_CONFIGS["sinkhorn"]["bucket_size"]


def test_train_main_with_a_typo_fails_before_loading_anything(tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        load_train_script().main(["--config", "no_such_option=1", "--output_dir", str(out)])
    assert exit_info.value.code == 2  # argparse's usage error, as on the command line
    err = capsys.readouterr().err
    assert "'no_such_option' is not a field of CompressiveConfig" in err and "segment_length" in err
    assert not out.exists()  # refused before the output folder, the data or the model


# ---- pkm_topk follows pkm_num_keys -------------------------------------------------------------------------------

TINY = {
    CompressiveConfig: dict(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        segment_length=8, mem_len=8, c_mem_len=4, compression_rate=2,
    ),
    SinkhornConfig: dict(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, bucket_size=4,
        max_position_embeddings=32, causal=True,
    ),
}  # fmt: skip
MODELS = {CompressiveConfig: CompressiveForCausalLM, SinkhornConfig: SinkhornForCausalLM}


@pytest.mark.parametrize("config_class", [CompressiveConfig, SinkhornConfig])
def test_pkm_topk_defaults_to_at_most_the_number_of_keys(config_class):
    assert config_class(pkm_layers=(1,), pkm_num_keys=16).pkm_topk == 16  # was refused: topk 32 > 16 keys
    assert config_class(pkm_layers=(1,), pkm_num_keys=64).pkm_topk == 32
    assert config_class().pkm_topk == 32  # pkm_num_keys 128
    assert config_class(pkm_num_keys=16, pkm_topk=8).pkm_topk == 8  # an explicit value is kept
    assert config_class(pkm_num_keys=16, pkm_topk=16).pkm_topk == 16
    with pytest.raises(ValueError, match=r"pkm_topk \(17\) must not exceed pkm_num_keys \(16\)"):
        config_class(pkm_layers=(1,), pkm_num_keys=16, pkm_topk=17)
    with pytest.raises(ValueError, match="pkm_num_keys"):
        config_class(pkm_num_keys=0)


@pytest.mark.parametrize("config_class", [CompressiveConfig, SinkhornConfig])
@pytest.mark.parametrize("num_keys,topk,expected", [(16, None, 16), (64, None, 32), (16, 8, 8), (128, 32, 32)])
def test_pkm_topk_round_trips_and_the_reloaded_model_is_the_same(tmp_path, config_class, num_keys, topk, expected):
    extra = {} if topk is None else {"pkm_topk": topk}
    config = config_class(**TINY[config_class], pkm_layers=[1], pkm_num_keys=num_keys, **extra)
    torch.manual_seed(0)
    model = MODELS[config_class](config).eval()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved.get("pkm_topk", expected) == expected  # the resolved value (omitted only when it is the default 32)
    reloaded = MODELS[config_class].from_pretrained(tmp_path).eval()
    assert reloaded.config.pkm_topk == expected
    memories = [m for m in reloaded.modules() if isinstance(m, ProductKeyMemory)]
    assert len(memories) == 1 and memories[0].topk == expected and memories[0].num_keys == num_keys
    ids = torch.randint(0, 40, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=0)
