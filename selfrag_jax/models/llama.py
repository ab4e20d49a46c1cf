"""A Flax Llama (Llama 2/3 shapes: RMSNorm, RoPE, grouped-query attention, SwiGLU).

Reads top to bottom like the paper's architecture. Conventions:
- Parameters are stored in `config.param_dtype` (float32 for training, bfloat16 optionally for
  inference) and carry logical axis names; `selfrag_jax.sharding` maps the names onto the
  mesh. Compute happens in `config.dtype`; norms, RoPE, softmax and logits in float32.
- RoPE uses Hugging Face's rotate-half layout, so HF q/k weights load without permutation.
- One call serves training and decoding. Without a cache, attention is causal within each
  packed segment (`segment_ids`, 0 = padding). With a `KVCache` the new tokens are written at
  each row's own end (`cache.end`), so rows of one batch can be at different lengths.
- The KV cache holds one `[batch, kv_heads, time, head_dim]` buffer per layer (never repeated
  for GQA), and decoding runs the layers unrolled over unstacked parameters: a layer scan
  would slice a stacked cache and stacked weights per layer, which XLA:CPU materialises as a
  copy of the whole cache and of every weight at each step (docs/decoding-at-scale.md).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import struct
from jax.ad_checkpoint import checkpoint_name

from selfrag_jax.models.config import LlamaConfig

NEG_INF = -1e30  # large finite negative: a fully masked row stays NaN-free


def _dtype(name: str):
    return jnp.dtype(name)


def constrain(x: jax.Array, *logical: str | None) -> jax.Array:
    """Pin an activation's sharding by logical names (no-op outside a mesh/rules context)."""
    return nn.with_logical_constraint(x, logical)


# --------------------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------------------
class KVCache(struct.PyTreeNode):
    """One buffer per layer, and the last call's keys and values not yet written into them
    (`pending`, at slots `pending_at` onwards): the next call writes them first, before
    anything reads the buffers, so that XLA updates the buffers in place instead of copying
    them to keep the old value for a read it could not order (docs/decoding-at-scale.md)."""

    k: tuple[jax.Array, ...]  # per layer: [batch, kv_heads, time, head_dim]
    v: tuple[jax.Array, ...]
    end: jax.Array  # [batch] int32: number of valid slots per row, pending ones included
    pending: tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]] | None = None  # (k, v) per layer: [b, kv, s, d]
    pending_at: jax.Array | None = None  # [batch] int32: the slot of each row's first pending one

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    @classmethod
    def zeros(cls, config: LlamaConfig, batch: int, max_len: int, dtype: Any = None) -> "KVCache":
        dtype = dtype or _dtype(config.dtype)
        shape = (batch, config.num_kv_heads, max_len, config.head_dim)
        layers = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))  # noqa: E731
        return cls(layers(), layers(), jnp.zeros((batch,), jnp.int32))

    def flush(self, carry_slots: int = 0) -> "KVCache":
        """The pending slots written into the buffers. With `carry_slots`, an empty pending
        block of that many slots follows at each row's end, so that a loop's carry keeps one
        shape (its first step writes those zeros past the valid slots: nothing anyone reads)."""
        k, v = self.k, self.v
        if self.pending is not None:
            k = tuple(_write(buf, new, self.pending_at) for buf, new in zip(k, self.pending[0]))
            v = tuple(_write(buf, new, self.pending_at) for buf, new in zip(v, self.pending[1]))
        if not carry_slots:
            return KVCache(k, v, self.end)
        empty = tuple(jnp.zeros((*x.shape[:2], carry_slots, x.shape[3]), x.dtype) for x in k)
        return KVCache(k, v, self.end, (empty, empty), self.end)

    def rows(self, idx: jax.Array, width: int | None = None) -> "KVCache":
        """The rows `idx` of a flushed cache (a gather), widened to `width` slots."""
        grow = ((0, 0), (0, 0), (0, (width or self.max_len) - self.max_len), (0, 0))
        take = lambda layers: tuple(jnp.pad(x[idx], grow) for x in layers)  # noqa: E731
        return KVCache(take(self.k), take(self.v), self.end[idx])


def _write(buf: jax.Array, new: jax.Array, at: jax.Array) -> jax.Array:
    """One layer's new slots [batch, kv_heads, length, head_dim] written at each row's slot `at`
    onwards, as one scatter; slots past the buffer's width are dropped."""
    b, s = new.shape[0], new.shape[2]
    slots = at[:, None] + jnp.arange(s)[None, :]  # [batch, length]
    # Index arrays on axes 0 and 2 put (batch, length) first: the update is laid out that way.
    return buf.at[jnp.arange(b)[:, None], :, slots, :].set(new.transpose(0, 2, 1, 3).astype(buf.dtype), mode="drop")


CACHE_LOGICAL = ("cache_batch", "cache_kv_heads", "cache_time", "head_dim")  # each layer's buffer


# --------------------------------------------------------------------------------------
# Rotary position embedding (Hugging Face layout, with Llama-3 frequency scaling)
# --------------------------------------------------------------------------------------
def rope_inv_freq(config: LlamaConfig) -> np.ndarray:
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = config.rope_scaling
    if rs.rope_type == "linear":
        inv_freq = inv_freq / rs.factor
    elif rs.rope_type == "llama3":
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def rope_tables(positions: jax.Array, config: LlamaConfig) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape [batch, length, head_dim] for integer positions [batch, length]."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(config))
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [batch, length, heads, head_dim]; rotate-half as in Hugging Face Llama."""
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


# --------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------
def dense(x: jax.Array, w: jax.Array, n_in: int = 1, out_dtype: Any = None) -> jax.Array:
    """x [..., *w.shape[:n_in]] times w -> [..., *w.shape[n_in:]], as one 2-D matmul.

    Merging the leading (batch, length) dims is a free reshape on every backend; XLA:CPU
    otherwise physically transposes 3-D activations for the weight gradients (measured on
    the 125M train step of `bench/bench_train.py`: transposing copies fell from 23% to 6% of
    op time, the step ~20% faster on 2 cores)."""
    lead, out = x.shape[:x.ndim - n_in], w.shape[n_in:]
    k = math.prod(w.shape[:n_in])
    y = jnp.matmul(x.reshape(-1, k), w.reshape(k, -1), preferred_element_type=out_dtype)
    return y.reshape(*lead, *out)


def _param(module: nn.Module, name: str, shape: tuple[int, ...], logical: tuple[str, ...], init=None):
    cfg = module.config
    init = init or nn.initializers.normal(cfg.initializer_range)
    return module.param(name, nn.with_logical_partitioning(init, logical), shape, _dtype(cfg.param_dtype))


class RMSNorm(nn.Module):
    config: LlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = _param(self, "scale", (self.config.hidden_size,), ("norm",), nn.initializers.ones)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.config.rms_norm_eps)
        return (scale * x32).astype(_dtype(self.config.dtype))


class Attention(nn.Module):
    config: LlamaConfig

    @nn.compact
    def __call__(self, x, cos, sin, mask, layer_cache):
        cfg = self.config
        dt = _dtype(cfg.dtype)
        e, h, kv, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        wq = _param(self, "wq", (e, h, d), ("embed", "heads", "head_dim"))
        wk = _param(self, "wk", (e, kv, d), ("embed", "kv_heads", "head_dim"))
        wv = _param(self, "wv", (e, kv, d), ("embed", "kv_heads", "head_dim"))
        wo = _param(self, "wo", (h, d, e), ("heads", "head_dim", "embed"))

        q = checkpoint_name(dense(x, wq.astype(dt)), "query_proj")  # [batch, length, heads, head_dim]
        k = checkpoint_name(dense(x, wk.astype(dt)), "key_proj")
        v = checkpoint_name(dense(x, wv.astype(dt)), "value_proj")
        q = constrain(apply_rope(q, cos, sin), "activation_batch", "activation_length", "activation_heads", None)
        k = apply_rope(k, cos, sin)
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [batch, kv_heads, length, head_dim]

        b, s = x.shape[:2]
        qg = q.reshape(b, s, kv, h // kv, d)
        scores = jnp.einsum("bskgd,bktd->bkgst", qg, k).astype(jnp.float32) / math.sqrt(d)
        if layer_cache is None:
            scores = jnp.where(mask[:, None, None, :, :], scores, NEG_INF)
            probs = jax.nn.softmax(scores, axis=-1).astype(dt)
            out = jnp.einsum("bkgst,bktd->bskgd", probs, v).reshape(b, s, h, d)
            return checkpoint_name(dense(out, wo.astype(dt), 2), "out_proj"), None
        # Decoding: attend over the written slots of the layer's cache and over the new keys
        # among themselves (causal), one softmax over both. The cache is only read here: the
        # new keys go back as pending, written by the next call before it reads.
        written, causal = mask  # [batch, time], [length, length]
        ck, cv = layer_cache[0].astype(dt), layer_cache[1].astype(dt)
        past = jnp.einsum("bskgd,bktd->bkgst", qg, ck).astype(jnp.float32) / math.sqrt(d)
        past = jnp.where(written[:, None, None, None, :], past, NEG_INF)
        scores = jnp.where(causal[None, None, None], scores, NEG_INF)
        probs = jax.nn.softmax(jnp.concatenate([past, scores], axis=-1), axis=-1).astype(dt)
        t = ck.shape[2]
        out = (jnp.einsum("bkgst,bktd->bskgd", probs[..., :t], cv) + jnp.einsum("bkgst,bktd->bskgd", probs[..., t:], v))
        out = out.reshape(b, s, h, d)
        out = checkpoint_name(dense(out, wo.astype(dt), 2), "out_proj")
        return out, (k, v)  # this call's keys and values: [batch, kv_heads, length, head_dim]


class MLP(nn.Module):
    config: LlamaConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        dt = _dtype(cfg.dtype)
        gate = _param(self, "gate", (cfg.hidden_size, cfg.intermediate_size), ("embed", "mlp"))
        up = _param(self, "up", (cfg.hidden_size, cfg.intermediate_size), ("embed", "mlp"))
        down = _param(self, "down", (cfg.intermediate_size, cfg.hidden_size), ("mlp", "embed"))
        hidden = jax.nn.silu(dense(x, gate.astype(dt))) * dense(x, up.astype(dt))
        hidden = constrain(hidden, "activation_batch", "activation_length", "activation_mlp")
        return dense(hidden, down.astype(dt))


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)). Signature fits `nn.scan`: (carry, xs, *bcast)."""

    config: LlamaConfig

    @nn.compact
    def __call__(self, x, layer_cache, cos, sin, mask):
        attn_out, new_cache = Attention(self.config, name="attn")(
            RMSNorm(self.config, name="attn_norm")(x), cos, sin, mask, layer_cache)
        x = x + attn_out
        x = x + MLP(self.config, name="mlp")(RMSNorm(self.config, name="mlp_norm")(x))
        x = constrain(x, "activation_batch", "activation_length", "activation_embed")
        return x, new_cache


REMAT_POLICY = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_qkv_out": jax.checkpoint_policies.save_only_these_names("query_proj", "key_proj", "value_proj", "out_proj"),
}


class Llama(nn.Module):
    config: LlamaConfig

    def setup(self):
        cfg = self.config
        self.embedding = _param(self, "embedding", (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"))
        layer = DecoderLayer
        if cfg.remat_policy != "none":
            layer = nn.remat(layer, policy=REMAT_POLICY[cfg.remat_policy], prevent_cse=not cfg.scan_layers)
        if cfg.scan_layers:
            self.layers = nn.scan(
                layer,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast),
                length=cfg.num_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )(cfg, name="layers")
        else:
            self.layer_list = [layer(cfg, name=f"layers_{i}") for i in range(cfg.num_layers)]
        self.final_norm = RMSNorm(cfg, name="final_norm")
        if not cfg.tie_word_embeddings:
            self.lm_head = _param(self, "lm_head", (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"))

    def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                 cache: KVCache | None = None, num_new: jax.Array | None = None, return_hidden: bool = False,
                 written_within: int | None = None):
        """tokens [batch, length] -> (logits [batch, length, vocab] float32, new cache or None).

        Training: `segment_ids` (0 = padding) keep packed examples apart; `positions` restart
        per segment. Decoding (unscanned layers: `models.params.for_decoding`): pass `cache`;
        the tokens take slots `cache.end + i`, and `num_new` [batch] (default: all) says how
        many of them are real, so right-padded prompts of different lengths prefill in one
        call. The returned cache holds this call's keys and values as pending (`KVCache`).
        `written_within` (static): no row has written past that slot yet, so attention reads
        only that much of the cache (a context copied into a cache widened for its suffix and
        answer).
        """
        cfg = self.config
        b, s = tokens.shape
        if cache is not None:
            if cfg.scan_layers:
                raise ValueError("decoding runs unscanned layers: convert with models.params.for_decoding")
            cache = cache.flush()
            slots = cache.end[:, None] + jnp.arange(s)[None, :]
            positions = slots if positions is None else positions
            # A query sees its row's written slots and the new tokens up to itself.
            past = cache.max_len if written_within is None else written_within
            mask = (jnp.arange(past)[None, :] < cache.end[:, None], jnp.tril(jnp.ones((s, s), bool)))
        else:
            positions = jnp.broadcast_to(jnp.arange(s)[None, :], (b, s)) if positions is None else positions
            seg = jnp.ones((b, s), jnp.int32) if segment_ids is None else segment_ids
            causal = jnp.tril(jnp.ones((s, s), bool))[None]
            mask = causal & (seg[:, :, None] == seg[:, None, :])
        # Masks built from constants (an empty cache, no segments) would be folded by XLA,
        # with the attention selects they feed, into literals at compile time: seconds per
        # unrolled layer on XLA:CPU (a 2-layer prefill of 64 x 256 compiled in 14 s, 0.3 s so).
        mask = jax.lax.optimization_barrier(mask)

        x = jnp.take(self.embedding, tokens, axis=0).astype(_dtype(cfg.dtype))
        x = constrain(x, "activation_batch", "activation_length", "activation_embed")
        cos, sin = rope_tables(positions, cfg)

        if cfg.scan_layers:
            x, _ = self.layers(x, None, cos, sin, mask)
        else:
            new_k, new_v = [], []
            for i, layer in enumerate(self.layer_list):
                layer_kv = None if cache is None else (cache.k[i][:, :, :past], cache.v[i][:, :, :past])
                x, out_kv = layer(x, layer_kv, cos, sin, mask)
                if out_kv is not None:
                    new_k.append(out_kv[0])
                    new_v.append(out_kv[1])

        new_cache = None
        if cache is not None:
            added = jnp.full((b,), s, jnp.int32) if num_new is None else num_new.astype(jnp.int32)
            new_cache = KVCache(cache.k, cache.v, cache.end + added, (tuple(new_k), tuple(new_v)), cache.end)

        x = self.final_norm(x)
        if return_hidden:
            return x, new_cache
        return self.logits(x), new_cache

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Output projection with float32 results (the loss and reflection-token probabilities
        need it). Weights stored in bfloat16 are multiplied as they are, accumulating in
        float32: a float32 copy of the vocabulary matrix per decode step would cost as much
        memory traffic as a tenth of a 7B model's weights."""
        w = self.embedding.T if self.config.tie_word_embeddings else self.lm_head
        logits = dense(hidden.astype(w.dtype), w, out_dtype=jnp.float32)
        return constrain(logits, "activation_batch", "activation_length", "activation_vocab")

    def last_logits(self, hidden: jax.Array, lengths: jax.Array) -> jax.Array:
        """`logits` of each right-padded row's last real position only (`lengths` [B]): [B, V]
        float32, without projecting the padding or the prompt onto the vocabulary."""
        last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)
        return self.logits(last)[:, 0]


# --------------------------------------------------------------------------------------
# Parameter helpers
# --------------------------------------------------------------------------------------
def _init_fn(config: LlamaConfig):
    model = Llama(config)

    def init(rng):
        return model.init(rng, jnp.zeros((1, 1), jnp.int32))["params"]

    return init


def abstract_params(config: LlamaConfig):
    """(abstract unboxed params, logical PartitionSpec tree) without allocating anything."""
    boxed = jax.eval_shape(_init_fn(config), jax.random.PRNGKey(0))
    return nn.unbox(boxed), nn.get_partition_spec(boxed)


def init_params(config: LlamaConfig, rng: jax.Array | int = 0, shardings: Any = None):
    """Random parameters (plain float32 arrays), born sharded when `shardings` is given."""
    if isinstance(rng, int):
        rng = jax.random.PRNGKey(rng)
    init = _init_fn(config)
    fn = jax.jit(lambda r: nn.unbox(init(r)), out_shardings=shardings)
    return fn(rng)


def param_logical_specs(config: LlamaConfig):
    return abstract_params(config)[1]


def param_shardings(config: LlamaConfig, mesh, rules=None):
    """NamedShardings for every parameter, after checking that each dimension divides."""
    from selfrag_jax import sharding

    rules = sharding.DEFAULT_RULES if rules is None else rules
    abstract, logical = abstract_params(config)
    sharding.check_tree_divisible(abstract, logical, mesh, rules)
    return sharding.tree_shardings(mesh, logical, rules)
