"""Conversion of sinkhorn-transformer (0.11.x) `SinkhornTransformerLM` checkpoints into `longrange` models.

Not needed to load a model (the modeling files never import it). Input: the reference model's state dict (or a
checkpoint dict holding it, or the state dict of its `AutoregressiveWrapper` / `Autopadder`) and the keyword
arguments its `SinkhornTransformerLM` was built with. Output: a [`SinkhornConfig`] and a state dict for
[`SinkhornForCausalLM`] (`causal=True`) or [`SinkhornForMaskedLM`].

The config reproduces the reference's modelling choices through options (axial positions, output-layer bias, the
final norm after the projection back to `emb_dim`, routed keys weighted like the values, the reference's iterative
top-k weights, the own bucket as a routing candidate, temperature 1 in the non-causal attention sort net, which
ignores `temperature`). What the reference does differently and cannot be expressed is listed by
[`known_differences`]; options with no counterpart at all raise `ValueError` naming the option.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .configuration_sinkhorn import SinkhornConfig

# SinkhornTransformerLM's keyword arguments and their defaults in sinkhorn-transformer 0.11.4
REFERENCE_DEFAULTS = {
    "heads": 8,
    "dim_head": None,
    "bucket_size": 64,
    "kv_bucket_size": None,
    "context_bucket_size": None,
    "causal": False,
    "non_permutative": True,
    "sinkhorn_iter": 5,
    "n_sortcut": 0,
    "temperature": 0.75,
    "reversible": False,
    "ff_chunks": 1,
    "ff_glu": False,
    "return_embeddings": False,
    "ff_dropout": 0.0,
    "attn_dropout": 0.0,
    "attn_layer_dropout": 0.0,
    "layer_dropout": 0.0,
    "emb_dropout": 0.0,
    "weight_tie": False,
    "emb_dim": None,
    "use_simple_sort_net": None,
    "receives_context": False,
    "context_n_sortcut": 0,
    "n_local_attn_heads": 0,
    "use_rezero": False,
    "n_top_buckets": 2,
    "pkm_layers": (),
    "pkm_num_keys": 128,
}
REQUIRED = ("num_tokens", "dim", "max_seq_len", "depth")


def _full_kwargs(kwargs: Mapping) -> dict:
    missing = [k for k in REQUIRED if k not in kwargs]
    if missing:
        raise ValueError(f"reference kwargs: missing required argument(s) {missing} of SinkhornTransformerLM")
    unknown = sorted(set(kwargs) - set(REFERENCE_DEFAULTS) - set(REQUIRED))
    if unknown:
        raise ValueError(f"reference kwargs: unknown argument(s) {unknown} (not SinkhornTransformerLM 0.11.4 options)")
    return {**REFERENCE_DEFAULTS, **kwargs}


def _refuse(kw: dict) -> None:
    """Raise for reference options that have no counterpart here."""

    def no(option, why):
        raise ValueError(f"cannot convert: {option} ({why})")

    if kw["receives_context"]:
        no(
            "receives_context=True",
            "the reference uses the raw context as keys and values of its context layers, with no projection and "
            "per-layer context feed-forwards; our cross-attention projects the context",
        )
    if kw["use_rezero"]:
        no("use_rezero=True", "ReZero residual gates instead of pre-LayerNorm are not implemented here")
    if kw["return_embeddings"]:
        no("return_embeddings=True", "the checkpoint has no output layer; convert a language model")
    if kw["kv_bucket_size"] not in (None, kw["bucket_size"]):
        no("kv_bucket_size != bucket_size", "self-attention here buckets keys like queries")
    if not kw["non_permutative"]:
        no(
            "non_permutative=False",
            "the reference's Gumbel-Sinkhorn path attends a soft mixture of all buckets and samples Gumbel noise "
            "even in eval mode (not a deterministic model); here Sinkhorn balancing only chooses buckets",
        )
    if kw["use_simple_sort_net"] and kw["causal"]:
        no("use_simple_sort_net=True with causal=True", "the causal simple sort net is not implemented here")
    if kw["max_seq_len"] < kw["bucket_size"]:
        no("max_seq_len < bucket_size", "the reference's axial position table would be empty")


def config_from_reference(kwargs: Mapping) -> SinkhornConfig:
    """A [`SinkhornConfig`] equivalent to `SinkhornTransformerLM(**kwargs)` (see the module docstring)."""
    kw = _full_kwargs(kwargs)
    _refuse(kw)
    bucket, causal = kw["bucket_size"], bool(kw["causal"])
    emb_dim = kw["emb_dim"] if kw["emb_dim"] not in (None, kw["dim"]) else None
    return SinkhornConfig(
        vocab_size=kw["num_tokens"],
        hidden_size=kw["dim"],
        num_hidden_layers=kw["depth"],
        num_attention_heads=kw["heads"],
        dim_head=kw["dim_head"],
        intermediate_size=4 * kw["dim"],
        ff_glu=kw["ff_glu"],
        emb_dim=emb_dim,
        # the reference's axial table has max_seq_len // bucket_size rows of bucket_size positions
        max_position_embeddings=(kw["max_seq_len"] // bucket) * bucket,
        axial_position_embeddings=True,
        bucket_size=bucket,
        causal=causal,
        n_top_buckets=kw["n_top_buckets"],
        n_sortcut=kw["n_sortcut"],
        sinkhorn_iter=kw["sinkhorn_iter"],
        # the non-causal attention sort net takes its top-k at temperature 1 whatever `temperature` says
        sort_temperature=kw["temperature"] if causal or kw["use_simple_sort_net"] else 1.0,
        use_simple_sort_net=bool(kw["use_simple_sort_net"]),
        simple_sort_net_scores="relu" if kw["use_simple_sort_net"] else "log_relu",
        non_permutative=True,
        weight_routed_values=True,
        weight_routed_keys=True,
        sequential_routing_weights=True,
        route_own_bucket=not causal,
        causal_key_summary="running_mean_sum" if causal else "mean",
        causal_null_score="zero" if causal else "learned",
        null_bucket_copies=causal,
        shifted_heads_skip_first_bucket=causal,
        n_local_attn_heads=kw["n_local_attn_heads"],
        reversible=kw["reversible"],
        ff_chunks=kw["ff_chunks"],
        weight_tie=kw["weight_tie"],
        # the product-key memory of product_key_memory.PKM(dim, num_keys): 4 heads, top 32, half-queries of 128
        pkm_layers=list(kw["pkm_layers"]),
        pkm_num_keys=kw["pkm_num_keys"],
        pkm_heads=4,
        pkm_topk=32,
        pkm_dim_key=128,
        pkm_norm_halves=True,
        layer_dropout=kw["layer_dropout"],
        emb_dropout=kw["emb_dropout"],
        ff_dropout=kw["ff_dropout"],
        attn_dropout=kw["attn_dropout"],
        attn_layer_dropout=kw["attn_layer_dropout"],
        lm_head_bias=True,
        norm_after_project_out=emb_dim is not None,
        tie_word_embeddings=False,
    )


def known_differences(kwargs: Mapping) -> list[str]:
    """What the converted model computes differently from the reference (empty: the same logits, within float
    rounding, on inputs without padding whose length is a multiple of bucket_size)."""
    kw = _full_kwargs(kwargs)
    out = []
    n_sink = kw["heads"] - kw["n_local_attn_heads"]
    if n_sink == 0:
        return out
    if kw["use_simple_sort_net"] and kw["n_top_buckets"] > 1:
        out.append(
            "simple sort net: relu(W x) scores are often exactly 0; where such ties decide a pick beyond the first, "
            "the reference follows torch.topk's unspecified order and the converted model the lowest bucket index"
        )
    if not kw["causal"] and kw["n_sortcut"] == 0:
        out.append(
            "non-causal routing without SortCut: the reference attends the chosen buckets' keys in place of their "
            "values (its defect 1); the converted model uses the values"
        )
    if kw["causal"]:
        out.append("causal inputs shorter than n_top_buckets buckets: the reference then uses fewer null buckets")
    return out


# -- state dict --------------------------------------------------------------------------------------------------


def _unwrap(checkpoint: Mapping) -> dict:
    """The model's own state dict from a checkpoint dict or a wrapper's state dict."""
    sd = checkpoint
    for key in ("state_dict", "model_state_dict", "model"):
        if isinstance(sd, Mapping) and key in sd and isinstance(sd[key], Mapping):
            sd = sd[key]
            break
    sd = {k.removeprefix("module."): v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    while "to_token_emb.weight" not in sd and any(k.startswith("net.") for k in sd):
        sd = {k.removeprefix("net."): v for k, v in sd.items() if k.startswith("net.")}
    if "to_token_emb.weight" not in sd:
        raise ValueError("not a SinkhornTransformerLM state dict: no 'to_token_emb.weight'")
    return sd


def convert_state_dict(checkpoint: Mapping, kwargs: Mapping) -> tuple[SinkhornConfig, dict[str, torch.Tensor]]:
    """(config, state dict of SinkhornForCausalLM / SinkhornForMaskedLM) for a reference checkpoint."""
    config = config_from_reference(kwargs)
    conversion = _StateDictConversion(_unwrap(checkpoint), config, reversible=_full_kwargs(kwargs)["reversible"])
    conversion.embeddings_and_output()
    if config.weight_tie:
        conversion.tied_layers()
    else:
        conversion.layers()
    unused = sorted(set(conversion.src) - conversion.used)
    if unused:
        raise ValueError(f"reference state dict has entries this conversion does not map: {unused[:8]}")
    return config, conversion.out


class _StateDictConversion:
    """Copies the reference's tensors (`src`) under our names (`out`), reshaped where the layouts differ.

    Every tensor is read through `take`, which records it: a reference tensor left unread means the conversion does
    not know it (the caller refuses the checkpoint rather than drop weights silently).
    """

    def __init__(self, src: dict[str, torch.Tensor], config: SinkhornConfig, reversible: bool):
        self.src, self.config, self.reversible = src, config, reversible
        self.used: set[str] = set()
        self.out: dict[str, torch.Tensor] = {}
        # the reference's layer stack; with factorised embeddings it is wrapped in a projecting module (`.fn`)
        self.stack = "sinkhorn_transformer." + ("fn." if config.emb_dim is not None else "")
        self.pkm = set(config.pkm_layers)  # 1-based layer numbers

    def take(self, name: str) -> torch.Tensor:
        if name not in self.src:
            raise ValueError(f"reference state dict has no '{name}' (do the kwargs match the checkpoint?)")
        self.used.add(name)
        return self.src[name]

    def branches(self, i: int) -> tuple[str, str]:
        """Prefixes of layer i's attention and feed-forward branches in the reference."""
        stack = self.stack
        if self.reversible:
            return f"{stack}layers.blocks.{i}.f.net.", f"{stack}layers.blocks.{i}.g.net."
        return f"{stack}layers.layers.{i}.0.", f"{stack}layers.layers.{i}.1."

    def embeddings_and_output(self) -> None:
        """Token and axial position embeddings, the factorised-embedding projections, final norm and output layer."""
        config, out, take = self.config, self.out, self.take
        out["model.embed_tokens.weight"] = take("to_token_emb.weight")
        rows = config.max_position_embeddings // config.bucket_size
        out["model.embed_positions.per_bucket"] = take("axial_pos_emb.weights.0").reshape(rows, -1)
        out["model.embed_positions.in_bucket"] = take("axial_pos_emb.weights.1").reshape(config.bucket_size, -1)
        norm = "model.norm"
        if config.emb_dim is not None:
            for part in ("weight", "bias"):
                out[f"model.project_in.{part}"] = take(f"sinkhorn_transformer.project_in.{part}")
                out[f"model.project_out.{part}"] = take(f"sinkhorn_transformer.project_out.{part}")
            if self.reversible:
                # the reference's reversible stack returns the sum of its two streams, ours their mean
                out["model.project_out.weight"] = 2 * out["model.project_out.weight"]
            norm = "model.norm_out"  # the reference normalises after the projection back (norm_after_project_out)
        for part in ("weight", "bias"):
            out[f"{norm}.{part}"] = take(f"norm.{part}")
            out[f"lm_head.{part}"] = take(f"to_logits.{part}")

    def layers(self) -> None:
        """Every layer with its own weights."""
        for i in range(self.config.num_hidden_layers):
            self.attention(i, f"model.layers.{i}.attention.")
            self.feed_forward(i, f"model.layers.{i}.feed_forward.")

    def tied_layers(self) -> None:
        """weight_tie: one attention and one feed-forward for all layers (product-key layers keep their own memory),
        each layer keeping its own pre-norms, as in the reference, whose state dict repeats the shared weights under
        every layer."""
        ff_layers = [i for i in range(self.config.num_hidden_layers) if i + 1 not in self.pkm]
        if not ff_layers:
            raise ValueError("cannot convert: weight_tie=True with every layer in pkm_layers (no shared feed-forward)")
        self.attention(0, "model.layers.0.attention.")
        self.feed_forward(ff_layers[0], "model.layers.0.feed_forward.")
        for i in sorted(self.pkm):
            self.feed_forward(i - 1, f"model.pkm_blocks.{i}.")
        for i in range(1, self.config.num_hidden_layers):
            self.tied_norm(self.branches(i)[0], self.branches(0)[0], f"model.layers.{i}.attention.")
        for i in ff_layers[1:]:
            self.tied_norm(self.branches(i)[1], self.branches(ff_layers[0])[1], f"model.layers.{i}.feed_forward.")

    def tied_norm(self, branch: str, first: str, ours: str) -> None:
        """A weight-tied layer's own pre-norm; its other weights must repeat those of the first layer's `first`."""
        for part in ("weight", "bias"):
            self.out[f"{ours}norm.{part}"] = self.take(f"{branch}norm.{part}")
        for name in [k for k in self.src if k.startswith(branch) and not k.startswith(f"{branch}norm.")]:
            other = first + name[len(branch) :]
            if other not in self.src or not torch.equal(self.src[name], self.src[other]):
                raise ValueError(
                    f"cannot convert: weight_tie=True but '{name}' differs from '{other}' (the reference shares "
                    "these weights between layers: is the checkpoint from a weight_tie=True model?)"
                )
            self.used.add(name)

    def attention(self, i: int, ours: str) -> None:
        """Layer i's pre-norm, projections, sort net (non-causal simple sort net) and null buckets (causal)."""
        config, out, take = self.config, self.out, self.take
        f = self.branches(i)[0]
        for part in ("weight", "bias"):
            out[f"{ours}norm.{part}"] = take(f"{f}norm.{part}")
        attn = f"{ours}attention."
        for name in ("to_q.weight", "to_kv.weight", "to_out.weight", "to_out.bias"):
            out[attn + name] = take(f"{f}fn.{name}")
        n_sink = config.num_attention_heads - config.n_local_attn_heads
        group = 1 if config.n_local_attn_heads > 0 else 0  # the local heads' group comes first
        if not config.causal:
            if config.use_simple_sort_net:
                sort_net = take(
                    f"{f}fn.sinkhorn_attention.sort_net.linear"
                )  # read even when unused (no sinkhorn heads)
                if n_sink > 0:
                    out[f"{attn}groups.{group}.sort_net"] = sort_net[0]
            return
        nulls = [take(f"{f}fn.sinkhorn_attention.{name}") for name in ("null_keys", "null_values")]  # [heads, 1, d]
        if n_sink == 0:
            return  # the reference keeps empty null tables
        # our Sinkhorn heads come in two groups, plain and shifted (the seed's rotated heads), each its own tables
        plain = n_sink // 2
        slices = [(0, plain), (plain, n_sink)] if plain > 0 else [(0, n_sink)]
        for name, null in zip(("null_keys", "null_values"), nulls):
            null = null.expand(-1, config.n_top_buckets, -1)  # the reference's null buckets share one key/value
            for j, (s, e) in enumerate(slices):
                out[f"{attn}groups.{group + j}.{name}"] = null[s:e].clone()  # [heads in group, n_top_buckets, d]

    def feed_forward(self, i: int, ours: str) -> None:
        """Layer i's pre-norm and feed-forward, or its product-key memory."""
        out, take = self.out, self.take
        g = self.branches(i)[1]
        for part in ("weight", "bias"):
            out[f"{ours}norm.{part}"] = take(f"{g}norm.{part}")
        if i + 1 in self.pkm:
            self.product_key_memory(f"{g}fn.", f"{ours}net.")
            return
        w1, b1 = take(f"{g}fn.fn.w1.weight"), take(f"{g}fn.fn.w1.bias")
        if self.config.ff_glu:
            # the reference gates with the second half (GELU on the first); ours applies GELU to the second half
            w1, b1 = torch.cat(w1.chunk(2)[::-1]), torch.cat(b1.chunk(2)[::-1])
        out[f"{ours}net.up.weight"], out[f"{ours}net.up.bias"] = w1, b1
        out[f"{ours}net.down.weight"] = take(f"{g}fn.fn.w2.weight")
        out[f"{ours}net.down.bias"] = take(f"{g}fn.fn.w2.bias")

    def product_key_memory(self, theirs: str, ours: str) -> None:
        out, take = self.out, self.take
        heads, dim_key = self.config.pkm_heads, self.config.pkm_dim_key
        # queries: the reference's rows are ordered (half, head, d), ours (head, half, d); keys likewise
        queries = take(f"{theirs}to_queries.weight").reshape(2, heads, dim_key, -1).transpose(0, 1)
        out[f"{ours}to_queries.weight"] = queries.reshape(2 * heads * dim_key, -1)
        out[f"{ours}keys"] = take(f"{theirs}keys").transpose(1, 2).contiguous()  # [heads, half, keys, d]
        out[f"{ours}values.weight"] = take(f"{theirs}values.weight")
        for part in ("weight", "bias"):
            out[f"{ours}query_norm.{part}"] = take(f"{theirs}norm.{part}")


def convert(checkpoint: Mapping, kwargs: Mapping):
    """A ready model (eval mode) for a reference checkpoint: SinkhornForCausalLM or SinkhornForMaskedLM."""
    from .modeling_sinkhorn import SinkhornForCausalLM, SinkhornForMaskedLM

    config, state = convert_state_dict(checkpoint, kwargs)
    model = (SinkhornForCausalLM if config.causal else SinkhornForMaskedLM)(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"conversion produced a mismatched state dict: missing {missing}, unexpected {unexpected}")
    return model.eval()


__all__ = ["REFERENCE_DEFAULTS", "config_from_reference", "convert", "convert_state_dict", "known_differences"]
