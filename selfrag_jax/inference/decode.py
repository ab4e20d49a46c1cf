"""Greedy decoding with the KV cache: ragged prefill, then a compiled loop, no host sync.

Plain generation for the critic (`annotate`) and the probes; the Self-RAG engine
(`engine.py`) has its own compiled segment step and shares only `pad_batch`. Prompts of different
lengths share one prefill call (right-padded, each row writes its own length into the
cache); the loop runs inside `lax.while_loop` until every row has emitted a stop token or
the step budget is spent.
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from selfrag_jax.models.config import LlamaConfig
from selfrag_jax.models.llama import KVCache, Llama
from selfrag_jax.models.params import for_decoding


def pad_batch(seqs: Sequence[Sequence[int]], pad_id: int, length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token lists to one array; returns (tokens [B, L], lengths [B])."""
    lengths = np.array([len(s) for s in seqs], np.int32)
    width = int(length or lengths.max())
    out = np.full((len(seqs), width), pad_id, np.int32)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out, lengths


@partial(jax.jit, static_argnames=("config", "max_new_tokens"))
def greedy_generate(params, config: LlamaConfig, tokens: jax.Array, lengths: jax.Array, max_new_tokens: int,
                    stop_ids: jax.Array, pad_id: int | jax.Array = 0):
    """tokens [B, P] right-padded with `lengths` [B] -> (new tokens [B, N], counts [B]).

    A row stops after its first token in `stop_ids` (kept in the output); later positions
    hold `pad_id`.
    """
    params, config = for_decoding(params, config)  # once per call, outside the loop
    model = Llama(config)
    b, p = tokens.shape
    cache = KVCache.zeros(config, b, p + max_new_tokens)
    logits, cache = model.apply({"params": params}, tokens, cache=cache, num_new=lengths)
    cache = cache.flush(carry_slots=1)  # the loop's carry: one pending slot per step
    first = jnp.argmax(jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0], axis=-1)

    out = jnp.full((b, max_new_tokens), pad_id, jnp.int32)

    def cond(state):
        step, _, _, done, _, _ = state
        return (step < max_new_tokens) & ~jnp.all(done)

    def body(state):
        step, token, cache, done, out, counts = state
        out = out.at[:, step].set(jnp.where(done, pad_id, token))
        counts = counts + (~done).astype(jnp.int32)
        done = done | jnp.isin(token, stop_ids)
        logits, cache = model.apply({"params": params}, token[:, None], cache=cache)
        return step + 1, jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32), cache, done, out, counts

    state = (0, first.astype(jnp.int32), cache, jnp.zeros((b,), bool), out, jnp.zeros((b,), jnp.int32))
    _, _, _, _, out, counts = jax.lax.while_loop(cond, body, state)
    return out, counts
