"""The sharded trainer for the Self-RAG critic and generator.

The path of one run, top to bottom:
1. mesh and rules from the config; the model config from a preset or a checkpoint;
2. the train state is born sharded: `eval_shape` of the initialiser gives abstract boxed
   parameters and optimizer state, their logical names give shardings, and a jitted
   initialiser with those `out_shardings` creates them in place (or a checkpoint is
   restored into the same abstract tree, on whatever mesh this run has);
3. a jitted train step (donated state, explicit in/out shardings) with gradient
   accumulation over micro-batches in a `lax.scan`;
4. the loop: per-host batches become global arrays, metrics every `log_every` steps
   (metrics.jsonl, TensorBoard, a progress bar), Orbax checkpoints every N steps with the
   data position, a clean save-and-exit on SIGTERM, and a stop naming the step if the loss
   is ever NaN or infinite (that step's update is skipped, so the last checkpoint and the
   in-memory state stay good).
"""

from __future__ import annotations

import json
import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn

from selfrag_jax import distributed, sharding
from selfrag_jax.chips import chip_of
from selfrag_jax.data.pack import BATCH_KEYS
from selfrag_jax.models.config import LlamaConfig, preset
from selfrag_jax.models.llama import Llama
from selfrag_jax.training.checkpointing import CheckpointIO
from selfrag_jax.training.config import TrainConfig
from selfrag_jax.training.logging import MetricsLogger
from selfrag_jax.training.state import TrainState

BATCH_LOGICAL = ("activation_batch", "activation_length")


class NonFiniteLoss(RuntimeError):
    pass


class DataSource(Protocol):
    """What the trainer needs from a data pipeline: per-host numpy batches and a position."""

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]: ...

    def state(self) -> dict[str, Any]: ...

    def restore(self, state: dict[str, Any]) -> None: ...


# --------------------------------------------------------------------------------------
# Optimizer and loss
# --------------------------------------------------------------------------------------
def make_schedule(cfg: TrainConfig, num_steps: int) -> optax.Schedule:
    o = cfg.optim
    if o.schedule_steps and o.schedule_steps < num_steps:
        raise ValueError(f"optim.schedule_steps={o.schedule_steps} is shorter than the run ({num_steps} steps)")
    num_steps = o.schedule_steps or num_steps
    warmup = int(round(o.warmup_ratio * num_steps))
    end = o.learning_rate * o.end_lr_ratio
    if o.schedule == "constant":
        decay = optax.constant_schedule(o.learning_rate)
    elif o.schedule == "cosine":
        decay = optax.cosine_decay_schedule(o.learning_rate, max(num_steps - warmup, 1), alpha=o.end_lr_ratio)
    else:
        decay = optax.linear_schedule(o.learning_rate, end, max(num_steps - warmup, 1))
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, o.learning_rate, warmup), decay], [warmup])


def _decay_mask(params):
    """Weight decay on matrices only: never on norm scales."""
    return jax.tree_util.tree_map_with_path(lambda path, _: "norm" not in jax.tree_util.keystr(path), params)


def _embedding_mask(params):
    """The token embedding and an untied output matrix: the rows appended for reflection tokens."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: any(k in jax.tree_util.keystr(path) for k in ("'embedding'", "'lm_head'")), params)


def make_optimizer(cfg: TrainConfig, num_steps: int) -> optax.GradientTransformation:
    o = cfg.optim
    parts = [optax.clip_by_global_norm(o.grad_clip) if o.grad_clip > 0 else optax.identity(),
             optax.adamw(make_schedule(cfg, num_steps), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                         mask=_decay_mask)]
    if o.embedding_lr_scale != 1.0:  # only then: the optimizer state of existing runs keeps its structure
        parts.append(optax.masked(optax.scale(o.embedding_lr_scale), _embedding_mask))
    return optax.chain(*parts)


@jax.custom_vjp
def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """-log softmax(logits)[target] per position, float32.

    The gradient is written out, softmax - one_hot, as one elementwise pass over the logits:
    autodiff of log_softmax + take_along_axis materialises a zero array of the logits' size
    and scatters into it (a full extra pass over [tokens, vocab] on CPU)."""
    return _cross_entropy_fwd(logits, targets)[0]


def _cross_entropy_fwd(logits, targets):
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    nll = lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return nll, (logits, lse, targets)


def _cross_entropy_bwd(res, g):
    logits, lse, targets = res
    one_hot = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1) == targets[..., None]
    grad = (jnp.exp(logits - lse[..., None]) - one_hot) * g[..., None]
    return grad, None


cross_entropy.defvjp(_cross_entropy_fwd, _cross_entropy_bwd)


def loss_terms(params, batch: dict[str, jax.Array], model: Llama, averaging: str):
    """(numerator, (denominator, correct, trained tokens)) so that accumulation over
    micro-batches gives exactly the loss of the whole batch: loss = sum(num) / sum(den)."""
    logits, _ = model.apply({"params": params}, batch["inputs"], positions=batch["positions"],
                            segment_ids=batch["segment_ids"])
    nll = cross_entropy(logits, batch["targets"])
    w = batch["loss_weights"].astype(jnp.float32)
    correct = jnp.sum((jnp.argmax(logits, -1) == batch["targets"]) * (w > 0))
    trained = jnp.sum(w > 0)
    if averaging == "per_token":
        return jnp.sum(nll * w), (jnp.sum(w), correct, trained)
    # Per sequence: each packed segment's weighted mean, then the mean over segments.
    b, length = w.shape
    ids = (jnp.arange(b)[:, None] * length + batch["segment_ids"]).reshape(-1)
    seg_loss = jax.ops.segment_sum((nll * w).reshape(-1), ids, num_segments=b * length)
    seg_w = jax.ops.segment_sum(w.reshape(-1), ids, num_segments=b * length)
    valid = seg_w > 0
    per_seq = jnp.where(valid, seg_loss / jnp.where(valid, seg_w, 1.0), 0.0)
    return jnp.sum(per_seq), (jnp.sum(valid).astype(jnp.float32), correct, trained)


def make_train_step(cfg: TrainConfig, model_config: LlamaConfig, tx: optax.GradientTransformation,
                    schedule: optax.Schedule, rules):
    model = Llama(model_config)
    accum = cfg.accumulation_steps
    grad_fn = jax.value_and_grad(loss_terms, has_aux=True)

    def step_fn(state: TrainState, batch: dict[str, jax.Array]):
        with nn.logical_axis_rules(rules):
            if accum == 1:
                (num, (den, correct, trained)), grads = grad_fn(state.params, batch, model, cfg.loss_averaging)
            else:
                # Micro-batch i takes rows i, i+accum, ...: every micro-batch keeps the
                # global batch's split over the data axes.
                micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1),
                                     batch)

                def body(carry, mb):
                    (n, (d, c, t)), g = grad_fn(state.params, mb, model, cfg.loss_averaging)
                    return jax.tree.map(jnp.add, carry, (n, d, c, t, g)), None

                zeros = (0.0, 0.0, 0, 0, jax.tree.map(jnp.zeros_like, state.params))
                (num, den, correct, trained, grads), _ = jax.lax.scan(body, zeros, micro)
            den = jnp.maximum(den, 1e-9)
            grads = jax.tree.map(lambda g: g / den, grads)
            loss = num / den
            grad_norm = optax.global_norm(grads)
            updates, new_opt = tx.update(grads, state.opt_state, state.params)
            new_params = optax.apply_updates(state.params, updates)
            bad = ~jnp.isfinite(loss) | ~jnp.isfinite(grad_norm)
            keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(bad, b, a), new, old)  # noqa: E731
            new_state = state.replace(
                step=state.step + 1,
                params=keep(new_params, state.params),
                opt_state=keep(new_opt, state.opt_state),
                first_bad_step=jnp.where((state.first_bad_step < 0) & bad, state.step, state.first_bad_step),
            )
            metrics = {"loss": loss, "accuracy": correct / jnp.maximum(trained, 1), "grad_norm": grad_norm,
                       "lr": schedule(state.step), "trained_tokens": trained}
            return new_state, metrics

    return step_fn


def make_eval_step(cfg: TrainConfig, model_config: LlamaConfig, rules):
    model = Llama(model_config)

    def eval_fn(params, batch):
        with nn.logical_axis_rules(rules):
            num, (den, correct, trained) = loss_terms(params, batch, model, cfg.loss_averaging)
            return num, den, correct, trained

    return eval_fn


# --------------------------------------------------------------------------------------
# Hardware accounting
# --------------------------------------------------------------------------------------
def measure_matmul_peak(n: int = 1024, repeats: int = 5, dtype=jnp.float32) -> float:
    """Matmul FLOP/s that JAX reaches on the default device (on a CPU: all local cores).
    Random data: products of zeros or ones run faster than real ones on some chips."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def total_peak_flops(cfg: TrainConfig) -> float:
    if cfg.peak_flops_per_device:
        return cfg.peak_flops_per_device * jax.device_count()
    chip = chip_of(jax.devices()[0].device_kind)
    if chip is not None:
        return chip.peak_flops * jax.device_count()
    # CPU: virtual devices share the same cores, so the measured peak is the whole machine's.
    return measure_matmul_peak() * jax.process_count()


# --------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------
@dataclass
class Trainer:
    cfg: TrainConfig
    model_config: LlamaConfig
    tokenizer: Any = None
    init_params: Any = None  # host parameters to start from (fine-tuning), else random
    mesh: Any = None  # default: built from cfg.mesh over all devices

    def __post_init__(self):
        cfg = self.cfg
        self.mesh = self.mesh or sharding.make_mesh(cfg.mesh)
        self.rules = sharding.rules_from_config(cfg.rules)
        groups = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        micro = cfg.global_batch_size // cfg.accumulation_steps
        if micro % groups:
            raise ValueError(f"micro-batch of {micro} sequences (global_batch_size / accumulation) is not divisible "
                             f"by the data x fsdp mesh axes = {groups}; change global_batch_size, micro_batch_size "
                             "or the mesh")
        if cfg.global_batch_size % jax.process_count():
            raise ValueError(f"global_batch_size={cfg.global_batch_size} is not divisible by the "
                             f"{jax.process_count()} hosts")
        self.run_dir = Path(cfg.run_dir)
        self.batch_sharding = sharding.logical_sharding(self.mesh, BATCH_LOGICAL, self.rules)

    # --- state -------------------------------------------------------------------------
    def _abstract_state(self, tx):
        model = Llama(self.model_config)

        def init(rng):
            boxed = model.init(rng, jnp.zeros((1, 1), jnp.int32))["params"]
            return TrainState(step=jnp.zeros((), jnp.int32), params=boxed, opt_state=tx.init(boxed),
                              first_bad_step=jnp.full((), -1, jnp.int32))

        abstract = jax.eval_shape(init, jax.random.PRNGKey(self.cfg.seed))
        logical = nn.get_partition_spec(abstract)
        shardings = sharding.tree_shardings(self.mesh, logical, self.rules)
        sharding.check_tree_divisible(nn.unbox(abstract).params, logical.params, self.mesh, self.rules)
        return init, nn.unbox(abstract), shardings

    def create_state(self, tx) -> TrainState:
        init, abstract, shardings = self._abstract_state(tx)
        self.state_shardings = shardings
        self.abstract_state = abstract
        if self.init_params is None:
            with jax.set_mesh(self.mesh):
                return jax.jit(lambda r: nn.unbox(init(r)), out_shardings=shardings)(jax.random.PRNGKey(self.cfg.seed))
        params = jax.device_put(self.init_params, shardings.params)
        with jax.set_mesh(self.mesh):
            opt_state = jax.jit(tx.init, out_shardings=shardings.opt_state)(params)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state,
                          first_bad_step=jnp.full((), -1, jnp.int32))

    def jit_train_step(self, tx, schedule, state_shardings):
        """The jitted train step that `fit` runs (donated state, explicit shardings); `plan`
        compiles this same function ahead of time for a target topology."""
        return jax.jit(make_train_step(self.cfg, self.model_config, tx, schedule, self.rules),
                       in_shardings=(state_shardings, self.batch_sharding),
                       out_shardings=(state_shardings, None), donate_argnums=(0,))

    # --- batches -----------------------------------------------------------------------
    def global_batch(self, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Assemble each host's rows into global arrays sharded over the data axes."""
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(local[k]))
                for k in BATCH_KEYS}

    # --- run ---------------------------------------------------------------------------
    def fit(self, data: DataSource, num_steps: int, eval_data: DataSource | None = None) -> dict[str, Any]:

        cfg = self.cfg
        schedule = make_schedule(cfg, num_steps)
        tx = make_optimizer(cfg, num_steps)
        state = self.create_state(tx)
        ckpt = CheckpointIO(self.run_dir / "checkpoints", cfg, self.model_config, self.tokenizer)
        restored = ckpt.restore_latest(self.abstract_state, self.state_shardings)
        if restored is not None:
            state, meta = restored
            states = meta["data_states"]
            if len(states) != jax.process_count():
                raise ValueError(f"checkpoint step {int(state.step)} holds data positions of {len(states)} hosts, "
                                 f"this run has {jax.process_count()}; resume with the same number of hosts")
            data.restore(states[jax.process_index()])
        start = int(state.step)

        step_fn = self.jit_train_step(tx, schedule, self.state_shardings)
        eval_fn = jax.jit(make_eval_step(cfg, self.model_config, self.rules),
                          in_shardings=(self.state_shardings.params, self.batch_sharding))
        tokens_per_step = cfg.global_batch_size * cfg.data.seq_len
        flops_per_step = self.model_config.flops_per_token(cfg.data.seq_len) * tokens_per_step
        peak = total_peak_flops(cfg)
        logger = MetricsLogger(self.run_dir, total=num_steps, initial=start, enabled=distributed.is_main())

        stop = {"signal": False}
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("signal", True))
        batches = iter(data)
        last_log, last_time, last = start, time.perf_counter(), {}
        try:
            for step in range(start, num_steps):
                local = next(batches)
                data_state = data.state()  # the position right after this step's batch
                with jax.set_mesh(self.mesh):
                    state, metrics = step_fn(state, self.global_batch(local))
                done = step + 1
                preempted = distributed.any_process(stop["signal"])
                if done % cfg.log_every == 0 or done == num_steps or preempted:
                    bad = int(state.first_bad_step)
                    if bad >= 0:
                        raise NonFiniteLoss(f"loss or gradients became NaN or infinite at step {bad + 1}; stopped. "
                                            f"The last good checkpoint is step {ckpt.latest_step()} in {ckpt.directory}")
                    now = time.perf_counter()
                    rate = (done - last_log) / max(now - last_time, 1e-9)
                    last = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    last.update(step=done, tokens_per_s=rate * tokens_per_step, mfu=rate * flops_per_step / peak)
                    if eval_data is not None and cfg.eval_every and (done % cfg.eval_every == 0 or done == num_steps):
                        last["eval_loss"] = self.evaluate(eval_fn, state.params, eval_data)
                    logger.log(last)
                    last_log, last_time = done, time.perf_counter()
                logger.advance(done)
                if done % cfg.checkpoint.every == 0 or done == num_steps or preempted:
                    ckpt.save(done, state, data_state, force_sync=preempted or done == num_steps)
                if preempted:
                    logger.message(f"SIGTERM: saved step {done} and stopped; run the same command to resume")
                    last = {**last, "preempted": True}
                    break
        finally:
            signal.signal(signal.SIGTERM, previous)
            ckpt.close()
            logger.close()
        self.state = state
        return last

    def evaluate(self, eval_fn, params, eval_data: DataSource) -> float:
        """Loss on the first `eval_batches` batches of the eval stream (the same ones each time)."""
        if not hasattr(self, "_eval_start"):
            self._eval_start = eval_data.state()
        eval_data.restore(self._eval_start)
        num = den = 0.0
        for i, local in enumerate(eval_data):
            if i >= self.cfg.eval_batches:
                break
            with jax.set_mesh(self.mesh):
                n, d, _, _ = eval_fn(params, self.global_batch(local))
            num, den = num + float(n), den + float(d)
        return num / max(den, 1e-9)


# --------------------------------------------------------------------------------------
# Building a run from a config
# --------------------------------------------------------------------------------------
def build_model(cfg: TrainConfig):
    """(model config, initial host params or None, tokenizer) for a run."""
    from selfrag_jax.tokenizer import SelfRAGTokenizer

    m = cfg.model
    tokenizer = SelfRAGTokenizer.from_pretrained(m.tokenizer) if m.tokenizer else None
    if m.init_from:
        from selfrag_jax.models.checkpoint import load_model
        from selfrag_jax.models.params import resize_vocab

        model_config, params, loaded_tok, _ = load_model(m.init_from, **m.overrides)
        tokenizer = tokenizer or loaded_tok
        if tokenizer is not None and len(tokenizer) > model_config.vocab_size:
            params, model_config = resize_vocab(params, model_config, len(tokenizer), method=m.new_token_init)
        return model_config, jax.tree.map(np.asarray, params), tokenizer
    if not m.preset:
        raise ValueError("model: set model.preset or model.init_from")
    overrides = dict(m.overrides)
    if tokenizer is not None:
        overrides.setdefault("vocab_size", len(tokenizer))
        overrides.setdefault("bos_token_id", tokenizer.bos_id)
        overrides.setdefault("eos_token_id", tokenizer.eos_id)
        overrides.setdefault("pad_token_id", tokenizer.pad_id)
    return preset(m.preset, **overrides), None, tokenizer


def resolve_num_steps(cfg: TrainConfig, num_examples: int | None, examples_per_step: float | None = None) -> int:
    """num_steps, or epochs x examples / examples per step (more than the batch size when packed)."""
    if cfg.num_steps:
        return cfg.num_steps
    if not num_examples:
        raise ValueError("num_steps=0 needs a data set of known size to derive steps from epochs")
    return max(1, math.ceil(cfg.epochs * num_examples / (examples_per_step or cfg.global_batch_size)))


def write_run_config(cfg: TrainConfig, model_config: LlamaConfig) -> None:
    if distributed.is_main():
        run = Path(cfg.run_dir)
        run.mkdir(parents=True, exist_ok=True)
        (run / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        model_config.save(run / "model_config.json")
