"""Initialisation of the Sinkhorn models: the defaults follow PyTorch's own (the sinkhorn-transformer package's)."""

import math

import torch

from longrange import SinkhornConfig, SinkhornForCausalLM

SIZE = dict(vocab_size=300, hidden_size=64, num_hidden_layers=1, num_attention_heads=2, bucket_size=8, causal=True)


# the tests read statistics of the weights: under no_grad, so no graph (and no warning for the scalar of a tensor
# that needs grad)
@torch.no_grad()
def test_default_init_is_pytorch_default_and_untied():
    torch.manual_seed(0)
    model = SinkhornForCausalLM(SinkhornConfig(**SIZE, max_position_embeddings=512, axial_position_embeddings=False))
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    # nn.Embedding's default: N(0, 1) (300 x 64 and 512 x 64 draws: the sample std is within a few percent)
    for emb in (model.model.embed_tokens.weight, model.model.embed_positions.weight):
        assert abs(float(emb.std()) - 1.0) < 0.05
    # the default axial tables (64 x 64 per bucket, 8 x 64 in a bucket): N(0, 1) each, as the reference's
    axial = SinkhornForCausalLM(SinkhornConfig(**SIZE, max_position_embeddings=512)).model.embed_positions
    assert axial.per_bucket.shape == (64, 64) and axial.in_bucket.shape == (8, 64)
    for table in (axial.per_bucket, axial.in_bucket):
        assert abs(float(table.std()) - 1.0) < 0.1
    # nn.Linear's default: U(-b, b) with b = 1/sqrt(fan_in), std b / sqrt(3)
    attention = model.model.layers[0].attention.attention
    for linear in (model.lm_head, attention.to_q, attention.to_out, model.model.layers[0].feed_forward.net.down):
        bound = 1 / math.sqrt(linear.in_features)
        w = linear.weight
        assert float(w.abs().max()) <= bound
        assert abs(float(w.std()) - bound / math.sqrt(3)) < 0.1 * bound / math.sqrt(3)
        if linear.bias is not None:
            assert float(linear.bias.abs().max()) <= bound and float(linear.bias.abs().max()) > 0


@torch.no_grad()
def test_float_initializer_range_and_tied_head():
    torch.manual_seed(0)
    model = SinkhornForCausalLM(SinkhornConfig(**SIZE, initializer_range=0.02))
    for w in (model.model.embed_tokens.weight, model.lm_head.weight):
        assert abs(float(w.std()) - 0.02) < 0.002
    tied = SinkhornForCausalLM(
        SinkhornConfig(**SIZE, max_position_embeddings=512, tie_word_embeddings=True, axial_position_embeddings=False)
    )
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    # a tied matrix is sized as an output layer (std 1/sqrt(hidden)); positions on the same scale
    for w in (tied.model.embed_tokens.weight, tied.model.embed_positions.weight):
        assert abs(float(w.std()) - 64**-0.5) < 0.05 * 64**-0.5
