"""longrange.compat: the model outputs carry the cache under the installed transformers' name (what generate() reads
between steps), accept `cache=` and answer `.cache` on every supported version."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree
from transformers.generation.utils import GenerateDecoderOnlyOutput

from longrange.compat import CACHE_NAME, BaseModelOutputWithPast, CausalLMOutputWithCrossAttentions
from longrange.modeling_compressive import CompressiveCausalLMOutput, CompressiveModelOutput


def test_cache_name_is_the_field_of_generates_own_output():
    assert CACHE_NAME in GenerateDecoderOnlyOutput.__dataclass_fields__
    assert CACHE_NAME in ("cache", "past_key_values")


@pytest.mark.parametrize(
    "output_class",
    [CompressiveModelOutput, CompressiveCausalLMOutput, BaseModelOutputWithPast, CausalLMOutputWithCrossAttentions],
)
def test_outputs_hold_the_cache_under_the_installed_name(output_class):
    cache, first = object(), torch.zeros(1, 2, 3)
    first_field = next(iter(output_class.__dataclass_fields__))
    out = output_class(**{first_field: first}, cache=cache)
    assert out.cache is cache
    assert list(out.keys()) == [first_field, CACHE_NAME]  # generate() looks for this key
    assert out[CACHE_NAME] is cache and getattr(out, CACHE_NAME) is cache
    assert out.to_tuple() == (first, cache)  # the cache once, after the first field
    # the installed version's own keyword gives the same output (pytree unflattening rebuilds outputs this way)
    again = output_class(**{first_field: first, CACHE_NAME: cache})
    assert again.cache is cache and list(again.keys()) == [first_field, CACHE_NAME]
    leaves, spec = pytree.tree_flatten(out)
    rebuilt = pytree.tree_unflatten(leaves, spec)
    assert type(rebuilt) is output_class and rebuilt.cache is cache and torch.equal(rebuilt[first_field], first)


@pytest.mark.skipif(CACHE_NAME == "cache", reason="both names are one field from transformers 5.24 on")
def test_cache_given_under_both_names_raises():
    with pytest.raises(ValueError, match="not both"):
        CompressiveModelOutput(last_hidden_state=torch.zeros(1), cache=object(), past_key_values=object())


@pytest.mark.skipif(CACHE_NAME == "cache", reason="assisted decoding is supported from transformers 5.24")
@pytest.mark.parametrize("family", ["compressive", "sinkhorn"])
def test_assisted_decoding_is_refused_clearly_before_transformers_5_24(family):
    from longrange import CompressiveConfig, CompressiveForCausalLM, SinkhornConfig, SinkhornForCausalLM

    if family == "compressive":
        model = CompressiveForCausalLM(CompressiveConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1,
                                                         num_attention_heads=2, segment_length=4, mem_len=4,
                                                         c_mem_len=2, compression_rate=2))  # fmt: skip
    else:
        model = SinkhornForCausalLM(SinkhornConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1,
                                                   num_attention_heads=2, bucket_size=4, causal=True,
                                                   max_position_embeddings=64))  # fmt: skip
    prompt = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    with pytest.raises(NotImplementedError, match="need transformers >= 5.24"):
        model.generate(prompt, prompt_lookup_num_tokens=2, max_new_tokens=4, do_sample=False, pad_token_id=0)
