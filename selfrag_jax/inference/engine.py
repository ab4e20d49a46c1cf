"""The compiled core of Self-RAG decoding: bucketed prefill and the segment step.

Two jitted programs do all the model work, and nothing syncs with the host per token:

- `prefill(contexts)`: right-padded contexts (questions, or beams in long form) fill a KV
  cache in one call; only the last position is projected onto the vocabulary, and the
  Retrieve-group log-probabilities come from its full softmax. That is the retrieval
  decision: no extra answer has to be decoded to make it.
- `decode(state, src, suffixes)`: every candidate row copies the cache row of its context
  (`src`), prefills its own suffix on top (a passage, or `[No Retrieval]`), then a
  `lax.while_loop` decodes all rows greedily until each emits a segment boundary (a
  Retrieve-group token, a Utility token, EOS) or hits its limit. Inside the loop the full
  softmax of each step yields the few critique probabilities Self-RAG scores with (IsRel at
  the first generated position, IsSup/IsUse at the first position where such a token was
  generated); only those and the tokens come back to the host.

Pruning splits `decode` in two programs: `read` prefills every row's suffix and returns its
IsRel probabilities; `decode_rows` then decodes only the rows the host kept (the best
passages by IsRel), so the K-fold decode of Self-RAG shrinks to the kept rows.

Row counts and lengths are padded to buckets, so a whole evaluation compiles a handful of
programs (`compiled_programs()` counts them). A server fixes them further (`Shapes`): every
prefill has the same rows, prompt lengths, candidate rows and suffix lengths take a few steps,
and `warm_up` compiles every program a request within those limits can need.

On a mesh (`Placement`), the programs are compiled with explicit shardings from the one rules
table in `selfrag_jax.sharding`: parameters as in training, the KV cache with its rows over the
batch axes and its KV heads over `tensor`, and everything the host reads back (tokens, counts,
critique probabilities) replicated. Host inputs are replicated global arrays, so on a
multi-host slice every process passes the same batch and gets the same results: one SPMD
program, no per-host bookkeeping.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, replace
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from selfrag_jax import sharding
from selfrag_jax import tokens as T
from selfrag_jax.inference.decode import pad_batch
from selfrag_jax.models.config import LlamaConfig
from selfrag_jax.models.llama import CACHE_LOGICAL, KVCache, Llama, param_shardings
from selfrag_jax.models.params import for_decoding

MIN_LENGTH_BUCKET = 16


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest of 1, 2, 4, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ... (four steps per
    octave above 8) that holds n: past 8 at most a fifth is padding, and the number of shapes
    grows only logarithmically, so few programs are compiled. Padding is paid in full:
    rows x length slots all run the MLPs, so a coarser ladder (two steps per octave, up to
    a third padding) made a K=5 Self-RAG batch of 160 rows x 106 tokens cost 192 x 128."""
    n = max(n, minimum)
    if n <= 8:
        return 1 << (n - 1).bit_length()
    step = 1 << ((n - 1).bit_length() - 3)
    return -(-n // step) * step


def bucket_length(n: int) -> int:
    return bucket(n, MIN_LENGTH_BUCKET)


def bucket_rows(n: int, multiple: int = 1) -> int:
    """Rows a batch of n is padded to: its bucket, rounded up to split over `multiple` devices."""
    return -(-bucket(n) // multiple) * multiple


@dataclass(frozen=True)
class ControlIds:
    """Reflection-token ids the compiled step needs (groups in the reference order)."""

    retrieve: tuple[int, ...]  # No Retrieval, Retrieval, Continue to Use Evidence
    isrel: tuple[int, ...]  # Irrelevant, Relevant
    issup: tuple[int, ...]  # Fully, Partially, No support
    isuse: tuple[int, ...]  # Utility:1..5
    eos: int
    pad: int

    @classmethod
    def from_tokenizer(cls, tok) -> "ControlIds":
        return cls(tok.retrieve_ids, tok.isrel_ids, tok.issup_ids, tok.isuse_ids, tok.eos_id, tok.pad_id)

    @classmethod
    def appended(cls, vocab_size: int, eos: int = 2) -> "ControlIds":
        """The ids a Self-RAG tokenizer gives the control tokens appended after a base
        vocabulary (the last 16, in the reference order; docs/method.md section 1): for models
        and plans that have no tokenizer at hand."""
        base = vocab_size - len(T.CONTROL_TOKENS)
        ids = {token: base + i for i, token in enumerate(T.CONTROL_TOKENS)}
        group = lambda g: tuple(ids[t] for t in g)  # noqa: E731
        return cls(group(T.RETRIEVE_GROUP), group(T.ISREL_GROUP), group(T.ISSUP_GROUP), group(T.ISUSE_GROUP), eos,
                   ids[T.PAD_TOKEN])

    @property
    def boundary(self) -> tuple[int, ...]:
        return (*self.retrieve, *self.isuse, self.eos)


@dataclass
class ContextState:
    """Prefilled contexts: the device cache plus, per real row, the retrieve statistics."""

    cache: KVCache
    lengths: np.ndarray  # [n] context lengths
    retrieve_logprobs: np.ndarray  # [n, 3] log p of the Retrieve group, full softmax
    greedy: np.ndarray  # [n] argmax token at the first generated position

    @property
    def retrieve_probs(self) -> np.ndarray:
        return np.exp(self.retrieve_logprobs)


@dataclass
class Segments:
    """Per candidate row: generated ids and what the scores need (numpy, real rows only)."""

    tokens: np.ndarray  # [n, max_new], pad after `counts`
    counts: np.ndarray  # [n]
    logprob_sum: np.ndarray  # [n] sum of log p of the generated tokens
    rel_probs: np.ndarray  # [n, 2] at the first generated position
    sup_probs: np.ndarray  # [n, 3] at the first generated IsSup token (0 if none)
    sup_found: np.ndarray  # [n] bool
    use_probs: np.ndarray  # [n, 5] at the first generated Utility token (0 if none)
    use_found: np.ndarray  # [n] bool

    def ids(self, row: int) -> list[int]:
        return self.tokens[row, : self.counts[row]].tolist()

    @property
    def seq(self) -> np.ndarray:
        """Mean log-probability of the generated tokens."""
        return self.logprob_sum / np.maximum(self.counts, 1)


@dataclass
class Reading:
    """Suffixes prefilled on their context rows (device cache and last logits), and the IsRel
    probabilities the host prunes with."""

    cache: KVCache
    logits: jax.Array  # [bucket rows, vocab] at each row's last suffix position
    rel_probs: np.ndarray  # [n, 2] (Irrelevant, Relevant), full softmax


@dataclass
class TokenCount:
    """Real (unpadded) tokens the engine processed: contexts and suffixes prefilled, and
    tokens generated. What a run costs, for reports and budgets."""

    prefill: int = 0
    decode: int = 0

    @property
    def total(self) -> int:
        return self.prefill + self.decode


@dataclass(frozen=True)
class Shapes:
    """The few shapes a server pads every call to, so that `Engine.warm_up` compiles them all
    before the first request: prefill always has `questions` rows; prompts double from a
    quarter of `prompt_tokens`; candidate rows double from `min_rows` up to every question's
    `ndocs` passages and its no-retrieval row; suffixes grow from `min_suffix` in steps of 1.5x
    and 4/3x, up to one passage (`passage_tokens`) for any rows and up to `suffix_tokens` (the
    naive baseline's row of all passages) for one row per question. Anything larger falls back
    to the buckets and compiles when met. Finer steps pad less but multiply the programs."""

    questions: int = 8
    ndocs: int = 5
    prompt_tokens: int = 128
    passage_tokens: int = 195  # one passage row, its markers included
    suffix_tokens: int = 512  # the longest row
    min_rows: int = 8
    min_suffix: int = 64

    @functools.cached_property
    def prompt_ladder(self) -> tuple[int, ...]:
        top = bucket_length(self.prompt_tokens)
        return _doubling(max(MIN_LENGTH_BUCKET, top // 4), top)

    @functools.cached_property
    def row_ladder(self) -> tuple[int, ...]:
        return _doubling(self.min_rows, self.questions * (self.ndocs + 1))

    @functools.cached_property
    def suffix_ladder(self) -> tuple[int, ...]:
        """Powers of two and 1.5x them (64, 96, 128, 192 ...): a suffix pads by at most a third,
        not up to half (a 70-token passage ran as 128 under plain doubling)."""
        steps = [self.min_suffix]
        while steps[-1] < self.suffix_tokens:
            steps.append(steps[-1] * 3 // 2 if steps[-1] & (steps[-1] - 1) == 0 else steps[-1] * 4 // 3)
        return tuple(steps)

    @functools.cached_property
    def segment_shapes(self) -> tuple[tuple[int, int], ...]:
        """(rows, suffix) of every segment step a call within the limits can make (per prompt length)."""
        one_passage = Shapes.fit(self.passage_tokens, self.suffix_ladder, bucket_length)
        per_question = Shapes.fit(self.questions, self.row_ladder, bucket)
        return tuple((rows, suffix) for rows in self.row_ladder for suffix in self.suffix_ladder
                     if suffix <= one_passage or rows <= per_question)

    @staticmethod
    def fit(n: int, ladder: Sequence[int], fallback) -> int:
        return next((x for x in ladder if x >= n), None) or fallback(n)


def _doubling(start: int, top: int) -> tuple[int, ...]:
    steps = [start]
    while steps[-1] < top:
        steps.append(steps[-1] * 2)
    return tuple(steps)


@dataclass(frozen=True)
class Placement:
    """Where the engine runs: a mesh and the logical-axis rules (the training defaults)."""

    mesh: Mesh
    rules: sharding.LogicalRules = sharding.DEFAULT_RULES

    def named(self, *logical: str | None) -> NamedSharding:
        return sharding.logical_sharding(self.mesh, logical, self.rules)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def cache(self, num_layers: int) -> KVCache:
        """A flushed KV cache's shardings (a KVCache of NamedShardings)."""
        kv = (self.named(*CACHE_LOGICAL),) * num_layers
        return KVCache(kv, kv, self.named("cache_batch"))

    @property
    def row_multiple(self) -> int:
        """Cache rows split evenly over the mesh axes that `cache_batch` maps to."""
        axes = sharding.logical_to_spec(("cache_batch",), self.rules)[0]
        axes = () if axes is None else axes if isinstance(axes, tuple) else (axes,)
        return int(np.prod([self.mesh.shape[a] for a in axes]))

    def params(self, config: LlamaConfig):
        return param_shardings(config, self.mesh, self.rules)

    def put(self, value: np.ndarray) -> jax.Array:
        """A host array as a replicated global array (every process holds the same value)."""
        value = np.asarray(value)
        return jax.make_array_from_callback(value.shape, self.replicated, lambda idx: value[idx])

    def scope(self):
        """Mesh and rules in effect while a program is traced (activation constraints)."""
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(nn.logical_axis_rules(self.rules))
        return stack


def constrain_cache(cache: KVCache) -> KVCache:
    """Keep a cache built inside a program (row gathers, the decode loop's carry) on the
    rules' layout instead of whatever XLA would infer (a no-op off a mesh)."""
    kv = lambda layers: tuple(nn.with_logical_constraint(x, CACHE_LOGICAL) for x in layers)  # noqa: E731
    rows = lambda x: None if x is None else nn.with_logical_constraint(x, ("cache_batch",))  # noqa: E731
    pending = None if cache.pending is None else (kv(cache.pending[0]), kv(cache.pending[1]))
    return KVCache(kv(cache.k), kv(cache.v), rows(cache.end), pending, rows(cache.pending_at))


class Engine:
    """Owns the compiled programs for one model and one `max_new_tokens`, on one device or,
    with a `placement`, sharded over its mesh (parameters must already carry its shardings:
    `models.checkpoint.load_model(..., shardings=placement.params(config))`)."""

    def __init__(self, params, config: LlamaConfig, ids: ControlIds, max_new_tokens: int,
                 placement: Placement | None = None, shapes: Shapes | None = None):
        params, config = for_decoding(params, config, placement.params if placement else None)
        self.params = params
        if shapes is not None:  # no suffix is longer than the model leaves beside an answer
            most = config.max_position_embeddings - max_new_tokens
            shapes = replace(shapes, suffix_tokens=min(shapes.suffix_tokens, most),
                             passage_tokens=min(shapes.passage_tokens, shapes.suffix_tokens, most))
        self.shapes = shapes
        self.config = config
        self.ids = ids
        self.max_new_tokens = int(max_new_tokens)
        self.placement = placement
        self.tokens = TokenCount()
        self.row_multiple = placement.row_multiple if placement else 1
        p = placement
        if p is not None:
            self._check_placement(config, p)

        def jit(fn, ins, outs):
            return jax.jit(fn) if p is None else jax.jit(fn, in_shardings=ins, out_shardings=outs)

        params_s, cache_s, rep, rows = ((p.params(config), p.cache(config.num_layers), p.replicated, p.named("cache_batch", None))
                                        if p else (None,) * 4)
        self._prefill = jit(self._prefill_impl, (params_s, rep, rep), (cache_s, rep, rep))
        self._decode = jit(self._decode_impl, (params_s, cache_s, rep, rep, rep, rep), rep)
        self._read = jit(self._read_impl, (params_s, cache_s, rep, rep, rep), (cache_s, rows, rep))
        self._decode_rows = jit(self._decode_rows_impl, (params_s, cache_s, rows, rep, rep), rep)

    @classmethod
    def load(cls, model: str, max_new_tokens: int, mesh: str | None = None, dtype: str = "float32",
             rules: sharding.LogicalRules = sharding.DEFAULT_RULES, shapes: Shapes | None = None):
        """(engine, tokenizer) of a checkpoint, HF folder or GGUF file; with `mesh` (a mesh spec as `train`
        takes it) the parameters load straight into their shardings, in `dtype`."""
        from selfrag_jax.models.checkpoint import load_model

        placement = Placement(sharding.make_mesh(mesh), rules) if mesh else None
        config, params, tok, _ = load_model(model, scan_layers=False, dtype=dtype,  # the layout decoding runs
                                            shardings=placement.params if placement else None)
        if tok is None:
            raise ValueError(f"{model}: no tokenizer files next to the model")
        return cls(params, config, ControlIds.from_tokenizer(tok), max_new_tokens, placement, shapes), tok

    @staticmethod
    def _check_placement(config: LlamaConfig, placement: Placement) -> None:
        """Cache shapes must split over the mesh (a one-line error naming the config value)."""
        shape = (placement.row_multiple, config.num_kv_heads, 1, config.head_dim)
        sharding.check_divisible("KV cache", shape, CACHE_LOGICAL, placement.mesh, placement.rules)

    # --- host side -------------------------------------------------------------------
    def _call(self, program, *args):
        """Run a compiled program: host arrays become replicated global arrays on a mesh, and
        the mesh and rules are in effect while it is traced."""
        if self.placement is None:
            return program(*args)
        args = [self.placement.put(a) if isinstance(a, np.ndarray) else a for a in args]
        with self.placement.scope():
            return program(*args)

    def prefill(self, contexts: Sequence[Sequence[int]]) -> ContextState:
        n = len(contexts)
        rows = list(contexts) + [[self.ids.pad]] * (self._context_rows(n) - n)
        longest = max(map(len, rows))
        tokens, lengths = pad_batch(rows, self.ids.pad, Shapes.fit(longest, self.shapes.prompt_ladder, bucket_length)
                                    if self.shapes else bucket_length(longest))
        cache, ret_lp, greedy = self._call(self._prefill, self.params, tokens, lengths)
        ret_lp, greedy = np.asarray(ret_lp), np.asarray(greedy)
        self.tokens.prefill += int(lengths[:n].sum())
        return ContextState(cache, lengths[:n], ret_lp[:n], greedy[:n])

    def decode(self, state: ContextState, src: Sequence[int], suffixes: Sequence[Sequence[int]],
               limits: Sequence[int] | None = None) -> Segments:
        """Decode one segment for each (context row `src[i]`, suffix `suffixes[i]`).

        A row's limit defaults to `max_new_tokens`; 0 skips the row."""
        n = len(src)
        src_arr, tokens, lengths = self._suffix_batch(src, suffixes)
        out = self._call(self._decode, self.params, state.cache, src_arr, tokens, lengths, self._limits(n, limits))
        self.tokens.prefill += int(lengths[:n].sum())
        return self._segments(out, n)

    def read(self, state: ContextState, src: Sequence[int], suffixes: Sequence[Sequence[int]]) -> Reading:
        """Prefill each suffix on a copy of its context row (`decode`'s first half)."""
        n = len(src)
        src_arr, tokens, lengths = self._suffix_batch(src, suffixes)
        cache, logits, rel = self._call(self._read, self.params, state.cache, src_arr, tokens, lengths)
        self.tokens.prefill += int(lengths[:n].sum())
        return Reading(cache, logits, np.asarray(rel)[:n])

    def decode_rows(self, reading: Reading, rows: Sequence[int], limits: Sequence[int] | None = None) -> Segments:
        """Decode one segment for the read rows `rows` only (`decode`'s second half)."""
        n = len(rows)
        out = self._call(self._decode_rows, self.params, reading.cache, reading.logits, self._padded(rows),
                         self._limits(n, limits))
        return self._segments(out, n)

    def bucket_rows(self, n: int) -> int:
        if self.shapes:
            n = Shapes.fit(n, self.shapes.row_ladder, bucket)
        return bucket_rows(n, self.row_multiple)

    def _context_rows(self, n: int) -> int:
        return self.bucket_rows(self.shapes.questions if self.shapes and n <= self.shapes.questions else n)

    def _suffix_length(self, n: int) -> int:
        return Shapes.fit(n, self.shapes.suffix_ladder, bucket_length) if self.shapes else bucket_length(n)

    def warm_up(self) -> int:
        """Compile every program calls within `shapes` can need (prefill, and the segment step
        at each candidate-row and suffix size); returns how many programs that compiled."""
        if self.shapes is None:
            raise ValueError("warm_up needs the engine's Shapes")
        before = sum(self.compiled_programs().values())
        tokens = TokenCount(self.tokens.prefill, self.tokens.decode)
        for prompt in self.shapes.prompt_ladder:
            state = self.prefill([[self.ids.pad] * prompt] * self.shapes.questions)
            for rows, length in self.shapes.segment_shapes:
                self.decode(state, [0] * rows, [[self.ids.pad] * length] * rows, [1] * rows)
        self.tokens = tokens  # warm-up is not work done for anyone
        return sum(self.compiled_programs().values()) - before

    def _padded(self, values: Sequence[int]) -> np.ndarray:
        """int32 [bucket rows of n]: the values, then zeros (padding rows)."""
        out = np.zeros(self.bucket_rows(len(values)), np.int32)
        out[: len(values)] = values
        return out

    def _suffix_batch(self, src: Sequence[int], suffixes: Sequence[Sequence[int]]):
        """(context row per row, suffix tokens, suffix lengths), rows and length bucketed."""
        rows = list(suffixes) + [[self.ids.pad]] * (self.bucket_rows(len(src)) - len(src))
        tokens, lengths = pad_batch(rows, self.ids.pad, self._suffix_length(max(map(len, rows))))
        return self._padded(src), tokens, lengths

    def _limits(self, n: int, limits: Sequence[int] | None) -> np.ndarray:
        """Per-row token limits (default and cap: max_new_tokens); padding rows get 0 (skipped)."""
        return self._padded([self.max_new_tokens] * n if limits is None
                            else [min(int(x), self.max_new_tokens) for x in limits])

    def _segments(self, out, n: int) -> Segments:
        seg = Segments(*(np.asarray(x)[:n] for x in out))
        self.tokens.decode += int(seg.counts.sum())
        return seg

    def compiled_programs(self) -> dict[str, int]:
        return {name: getattr(self, "_" + name)._cache_size() for name in ("prefill", "decode", "read", "decode_rows")}

    # --- compiled side -----------------------------------------------------------------
    def _model(self) -> Llama:
        return Llama(self.config)

    def _last_logits(self, params, hidden, lengths):
        return self._model().apply({"params": params}, hidden, lengths, method=Llama.last_logits)

    def _prefill_impl(self, params, tokens, lengths):
        b, p = tokens.shape
        cache = KVCache.zeros(self.config, b, p)
        hidden, cache = self._model().apply({"params": params}, tokens, cache=cache, num_new=lengths, return_hidden=True,
                                            written_within=0)  # an empty cache: attention over the prompts only
        logits = self._last_logits(params, hidden, lengths)
        ret_lp = jax.nn.log_softmax(logits, axis=-1)[:, jnp.array(self.ids.retrieve)]
        return cache.flush(), ret_lp, jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def _decode_impl(self, params, ctx_cache: KVCache, src, suffix, suffix_len, limit):
        cache, logits = self._prefill_suffix(params, ctx_cache, src, suffix, suffix_len)
        return self._segment_loop(params, cache, logits, limit)

    def _read_impl(self, params, ctx_cache: KVCache, src, suffix, suffix_len):
        cache, logits = self._prefill_suffix(params, ctx_cache, src, suffix, suffix_len)
        return cache.flush(), logits, jax.nn.softmax(logits, axis=-1)[:, jnp.array(self.ids.isrel)]

    def _decode_rows_impl(self, params, cache: KVCache, logits, idx, limit):
        return self._segment_loop(params, constrain_cache(cache.rows(idx)), logits[idx], limit)

    def _prefill_suffix(self, params, ctx_cache: KVCache, src, suffix, suffix_len):
        """Copy context rows `src` into a cache wide enough for suffix and segment, prefill the
        suffixes: (cache, its suffixes pending; logits at each row's last suffix position)."""
        width = ctx_cache.max_len + suffix.shape[1] + self.max_new_tokens
        cache = constrain_cache(ctx_cache.rows(src, width))
        hidden, cache = self._model().apply({"params": params}, suffix, cache=cache, num_new=suffix_len,
                                            return_hidden=True, written_within=ctx_cache.max_len)
        return cache, self._last_logits(params, hidden, suffix_len)

    def _segment_loop(self, params, cache, logits, limit):
        """Greedy decode until each row's boundary token or limit; critique probs inside."""
        ids, n_new = self.ids, self.max_new_tokens
        model = self._model()
        b = logits.shape[0]
        boundary, issup, isuse = jnp.array(ids.boundary), jnp.array(ids.issup), jnp.array(ids.isuse)
        rel = jax.nn.softmax(logits, axis=-1)[:, jnp.array(ids.isrel)]
        # Each step writes the previous step's keys first (KVCache.pending): in place.
        cache = constrain_cache(cache.flush(carry_slots=1))

        def cond(s):
            return (s["step"] < n_new) & ~jnp.all(s["done"])

        def body(s):
            # Only the argmax, its log-probability and a few group probabilities are needed:
            # one logsumexp over the vocabulary instead of materialising its softmax.
            logits = s["logits"]
            lse = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
            group_probs = lambda g: jnp.exp(logits[:, jnp.array(g)] - lse)  # noqa: E731
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            live = ~s["done"]
            first_sup = live & ~s["sup_found"] & jnp.isin(token, issup)
            first_use = live & ~s["use_found"] & jnp.isin(token, isuse)
            count = s["count"] + live
            out = {
                "step": s["step"] + 1,
                "tokens": s["tokens"].at[:, s["step"]].set(jnp.where(live, token, ids.pad)),
                "count": count,
                "lp_sum": s["lp_sum"] + jnp.where(live, (jnp.take_along_axis(logits, token[:, None], 1) - lse)[:, 0], 0.0),
                "sup": jnp.where(first_sup[:, None], group_probs(ids.issup), s["sup"]),
                "sup_found": s["sup_found"] | first_sup,
                "use": jnp.where(first_use[:, None], group_probs(ids.isuse), s["use"]),
                "use_found": s["use_found"] | first_use,
                "done": s["done"] | (live & (jnp.isin(token, boundary) | (count >= limit))),
            }
            # Finished rows add nothing to their cache (num_new 0), so it stays their context.
            step_logits, out["cache"] = model.apply({"params": params}, token[:, None], cache=s["cache"],
                                                    num_new=live.astype(jnp.int32))
            out["cache"] = constrain_cache(out["cache"])
            out["logits"] = step_logits[:, 0]
            return out

        state = {
            "step": jnp.int32(0), "logits": logits, "cache": cache,
            "tokens": jnp.full((b, n_new), ids.pad, jnp.int32), "count": jnp.zeros((b,), jnp.int32),
            "lp_sum": jnp.zeros((b,), jnp.float32),
            "sup": jnp.zeros((b, len(ids.issup)), jnp.float32), "sup_found": jnp.zeros((b,), bool),
            "use": jnp.zeros((b, len(ids.isuse)), jnp.float32), "use_found": jnp.zeros((b,), bool),
            "done": limit <= 0,
        }
        s = jax.lax.while_loop(cond, body, state)
        return s["tokens"], s["count"], s["lp_sum"], rel, s["sup"], s["sup_found"], s["use"], s["use_found"]
