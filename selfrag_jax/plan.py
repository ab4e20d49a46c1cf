"""`selfrag-jax plan CONFIG --mesh SPEC`: will this config fit the target, before paying for it?

The train step that `train` runs (`Trainer.jit_train_step`: the config's optimizer, remat
policy, gradient accumulation, compute dtype and shardings) and one step of greedy decode
with a KV cache of the config's `data.seq_len` are compiled ahead of time for a TPU
topology on this CPU, through libtpu (`pip install '.[tpu]'`), on abstract shapes
(`jax.ShapeDtypeStruct` with a `NamedSharding`; nothing is allocated). XLA's own
`memory_analysis()` then gives the bytes per chip, which we hold against the chip's HBM.

When the config does not fit, `plan` re-plans the changes that would make it fit, in the
order that costs the least speed: remat_policy=full, FSDP over every chip, smaller
micro-batches (gradient accumulation), and finally a bigger slice; it reports the first that
fits. GPU targets (`8x h100`) have no ahead-of-time backend here: they get an analytic
estimate, labelled as such. Exit status: 0 fits, 1 does not fit, 2 bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from selfrag_jax.chips import ALIASES, CHIPS, GiB, Chip


# --------------------------------------------------------------------------------------
# Targets: product names -> chips, libtpu topologies and their HBM
# --------------------------------------------------------------------------------------
SPEC_HELP = ("a product name (v5p-32, v5e-64, v4-32, v6e-16), a libtpu topology (v5p:2x2x4, v5e:8x8) "
             "or GPUs (8x h100, 4x a100, h200)")


@dataclass(frozen=True)
class Target:
    spec: str
    chip: Chip
    num_chips: int
    topology: str | None = None  # libtpu topology name, TPU only
    host_bounds: tuple[int, int, int] = (1, 1, 1)

    def describe(self) -> str:
        if self.chip.kind == "gpu":
            return f"{self.num_chips}x {self.chip.name.upper()} ({self.chip.hbm_bytes / GiB:.0f} GiB each)"
        return (f"{self.spec}: {self.num_chips} chips of TPU {self.chip.name}, topology {self.topology}, "
                f"{self.chip.hbm_bytes / GiB:.0f} GiB HBM each")

    def scaled(self, factor: int) -> "Target":
        """The same chips, `factor` times as many (the 'bigger slice' suggestion)."""
        if self.chip.kind == "gpu":
            return parse_target(f"{self.num_chips * factor}x {self.chip.name}")
        count = self.num_chips * factor * (2 if self.chip.cores_in_name else 1)
        return parse_target(f"{self.chip.name}-{count}")


def slice_shape(chips: int, dims: int) -> tuple[int, ...]:
    """Chip grid of a standard slice: v5p/v4 16 chips -> 2x2x4; v5e/v6e 64 chips -> 8x8."""
    if chips < 1 or chips & (chips - 1):
        raise ValueError(f"{chips} chips is not a standard slice size (a power of two); give a topology like v5p:2x2x6")
    if dims == 3:
        if chips < 4:
            raise ValueError(f"{chips} chips: the smallest 3D slice has 4 chips (v5p-8, v4-8)")
        shape = [2, 2, 1]
    else:
        shape = [1, 1]
    while math.prod(shape) < chips:
        low = min(shape)
        i = max(j for j, s in enumerate(shape) if s == low)  # double the last of the smallest dims
        shape[i] *= 2
    return tuple(shape)


def parse_target(spec: str) -> Target:
    """'v5p-32' | 'v5e:8x8' | '8x h100' -> Target; anything else fails with one line."""
    text = spec.strip().lower()
    gpu = re.fullmatch(r"(?:(\d+)\s*x\s*)?([a-z]\d+)", text)
    if gpu and gpu.group(2) in CHIPS and CHIPS[gpu.group(2)].kind == "gpu":
        count = int(gpu.group(1) or 1)
        if count < 1:
            raise ValueError(f"--mesh {spec!r}: need at least one GPU")
        return Target(f"{count}x {gpu.group(2)}", CHIPS[gpu.group(2)], count)
    topo = re.fullmatch(r"([a-z0-9]+):(\d+(?:x\d+)+)", text)
    product = re.fullmatch(r"([a-z0-9]+)-(\d+)", text)
    match = topo or product
    name = ALIASES.get(match.group(1), match.group(1)) if match else None
    if not match or name not in CHIPS or CHIPS[name].kind != "tpu":
        raise ValueError(f"--mesh {spec!r} is not a target; use {SPEC_HELP}")
    chip = CHIPS[name]
    if topo:
        shape = tuple(int(x) for x in topo.group(2).split("x"))
        if len(shape) != chip.dims:
            raise ValueError(f"--mesh {spec!r}: TPU {name} topologies have {chip.dims} dimensions")
        chips = math.prod(shape)
        count = chips * (2 if chip.cores_in_name else 1)
        product_name = f"{name}-{count}"
    else:
        count = int(product.group(2))
        if chip.cores_in_name and count % 2:
            raise ValueError(f"--mesh {spec!r}: {name} product names count TensorCores (2 per chip), so the number is even")
        chips = count // 2 if chip.cores_in_name else count
        shape = slice_shape(chips, chip.dims)
        product_name = f"{name}-{count}"
    if chip.dims == 3:
        bounds = (2, 2, 1) if chips >= 4 else tuple(shape)
    else:
        bounds = (shape[0], shape[1], 1) if chips <= 8 else (2, 2, 1)
    return Target(product_name, chip, chips, f"{name}:{'x'.join(map(str, shape))}", bounds)


@lru_cache(maxsize=None)
def target_devices(target: Target) -> tuple[Any, ...]:
    """Abstract devices of a TPU topology, from libtpu on this (CPU) machine."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise RuntimeError("planning for TPUs needs libtpu on this machine: pip install '.[tpu]'") from None
    # Only abstract devices are made here, no chip is opened: let several plans (or a plan
    # beside a test run) load libtpu at once instead of failing on /tmp/libtpu_lockfile.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    desc = topologies.get_topology_desc(platform="tpu", topology_name=target.topology,
                                        chip_config_name=target.chip.chip_config,
                                        chips_per_host_bounds=target.host_bounds, num_slices=1)
    devices = tuple(desc.devices)
    if len(devices) != target.num_chips:
        raise RuntimeError(f"libtpu gave {len(devices)} devices for {target.topology}, expected {target.num_chips}")
    return devices


# --------------------------------------------------------------------------------------
# The model a config trains, without loading any weights
# --------------------------------------------------------------------------------------
def plan_model_config(cfg):
    """The LlamaConfig a run of `cfg` would train: from `model.init_from`'s config file when
    that folder is on this machine, else from `model.preset` (a plan needs shapes only)."""
    from selfrag_jax.models.config import SELFRAG_VOCAB, LlamaConfig, from_hf_dict, preset

    m = cfg.model
    if m.init_from and Path(m.init_from).exists():
        folder = Path(m.init_from)
        if (folder / "model_config.json").exists():
            config = LlamaConfig.load(folder / "model_config.json").replace(**m.overrides)
        elif (folder / "config.json").exists():
            config = from_hf_dict(json.loads((folder / "config.json").read_text()), str(folder / "config.json"),
                                  **m.overrides)
        else:
            raise ValueError(f"model.init_from={m.init_from!r} has no model_config.json or config.json to plan from")
        # build_model adds the reflection tokens (and <pad>) to a base Llama vocabulary.
        return config.replace(vocab_size=max(config.vocab_size, SELFRAG_VOCAB))
    if not m.preset:
        raise ValueError(f"model.init_from={m.init_from!r} is not on this machine; give the model's shape with "
                         "model.preset=selfrag-7b (or another preset)")
    return preset(m.preset, **m.overrides)


# --------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------
@dataclass
class Memory:
    """Bytes per chip. `total` = arguments + outputs - aliased (donated) + temporaries + code."""

    parameters: int = 0
    optimizer_state: int = 0
    kv_cache: int = 0
    arguments: int = 0
    outputs: int = 0
    aliased: int = 0
    temporaries: int = 0
    generated_code: int = 0
    total: int = 0
    hbm: int = 0
    fits: bool = False
    estimated: bool = False  # analytic (GPU) rather than XLA's memory_analysis
    error: str | None = None  # the compiler's out-of-memory message, or why nothing was compiled
    compile_s: float = 0.0


@dataclass
class Plan:
    config: str
    target: str
    description: str
    chips: int
    mesh: dict[str, int]
    model: dict[str, Any]
    train: Memory
    decode: Memory | None
    analytics: dict[str, float]
    margin: float
    overrides: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.train.fits and (self.decode is None or self.decode.fits)


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def _shard_bytes(abstract, shardings) -> int:
    """Bytes that one chip holds of a tree of arrays placed by NamedShardings."""
    import jax
    import numpy as np

    total = 0
    for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
        total += math.prod(s.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
    return total


def _with_shardings(abstract, shardings):
    import jax

    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def _finish(mem: Memory, compiled, started: float, margin: float) -> Memory:
    stats = compiled.memory_analysis()
    mem.arguments, mem.outputs = stats.argument_size_in_bytes, stats.output_size_in_bytes
    mem.aliased, mem.temporaries = stats.alias_size_in_bytes, stats.temp_size_in_bytes
    mem.generated_code = stats.generated_code_size_in_bytes
    mem.total = mem.arguments + mem.outputs - mem.aliased + mem.temporaries + mem.generated_code
    mem.fits = mem.total <= mem.hbm * (1 - margin)
    mem.compile_s = round(time.perf_counter() - started, 1)
    return mem


def _compile(lower, mem: Memory, margin: float) -> Memory:
    """Compile, or record the compiler's out-of-memory message (it refuses programs over HBM)."""
    started = time.perf_counter()
    try:
        compiled = lower().compile()
    except Exception as err:  # XLA raises JaxRuntimeError RESOURCE_EXHAUSTED for over-HBM programs
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if "RESOURCE_EXHAUSTED" not in text and "memory" not in text.lower():
            raise
        mem.error, mem.fits = text[:400], False
        needed = re.search(r"([\d.]+)([KMGT])i?B?\b", text.split("required", 1)[-1])
        if needed:  # the compiler's figure (temporaries, or all it used) plus the state it was given
            mem.temporaries = int(float(needed.group(1)) * 1024 ** "KMGT".index(needed.group(2)) * 1024)
            mem.total = mem.parameters + mem.optimizer_state + mem.kv_cache + mem.temporaries
        mem.compile_s = round(time.perf_counter() - started, 1)
        return mem
    return _finish(mem, compiled, started, margin)


# --------------------------------------------------------------------------------------
# Planning the train step and the decode step
# --------------------------------------------------------------------------------------
def plan_train(cfg, model_config, target: Target, margin: float) -> tuple[Memory, dict[str, int]]:
    """AOT-compile the trainer's own step for `target`; (per-chip memory, mesh sizes)."""
    import jax
    import jax.numpy as jnp

    from selfrag_jax import sharding
    from selfrag_jax.data.pack import BATCH_KEYS
    from selfrag_jax.training.trainer import Trainer, make_optimizer, make_schedule

    mesh = sharding.make_mesh(cfg.mesh, target_devices(target))
    trainer = Trainer(cfg, model_config, mesh=mesh)
    num_steps = cfg.num_steps or 1000  # only shapes the learning-rate schedule
    tx, schedule = make_optimizer(cfg, num_steps), make_schedule(cfg, num_steps)
    _, abstract, shardings = trainer._abstract_state(tx)
    mem = Memory(parameters=_shard_bytes(abstract.params, shardings.params),
                 optimizer_state=_shard_bytes(abstract.opt_state, shardings.opt_state),
                 hbm=target.chip.hbm_bytes)
    state_floor = 2 * mem.parameters + mem.optimizer_state  # parameters, gradients, optimizer state
    if state_floor > mem.hbm * (1 - margin):
        mem.error = (f"parameters, gradients and optimizer state alone need {_gib(state_floor)} per chip "
                     f"(not compiled)")
        mem.total = state_floor
        return mem, dict(mesh.shape)
    rows, seq = cfg.global_batch_size, cfg.data.seq_len
    batch = {k: jax.ShapeDtypeStruct((rows, seq), jnp.float32 if k == "loss_weights" else jnp.int32,
                                     sharding=trainer.batch_sharding) for k in BATCH_KEYS}
    step = trainer.jit_train_step(tx, schedule, shardings)
    state = _with_shardings(abstract, shardings)

    def lower():
        with jax.set_mesh(mesh):
            return step.lower(state, batch)

    return _compile(lower, mem, margin), dict(mesh.shape)


def plan_decode(cfg, model_config, target: Target, batch: int, margin: float) -> Memory:
    """AOT-compile one greedy decode step (the body of `greedy_generate`'s loop) with a KV
    cache of `data.seq_len` slots, parameters sharded as in training."""
    import jax
    import jax.numpy as jnp
    from flax import linen as nn

    from selfrag_jax import sharding
    from selfrag_jax.inference.engine import Placement
    from selfrag_jax.models.llama import Llama, abstract_params, param_shardings

    mesh = sharding.make_mesh(cfg.mesh, target_devices(target))
    rules = sharding.rules_from_config(cfg.rules)
    groups = mesh.shape["data"] * mesh.shape["fsdp"]
    if batch % groups:
        raise ValueError(f"--decode-batch {batch} is not divisible by the data x fsdp mesh axes = {groups}")
    model_config = model_config.replace(scan_layers=False)  # the layout decoding runs
    params, _ = abstract_params(model_config)
    pshard = param_shardings(model_config, mesh, rules)
    cache_shardings = Placement(mesh, rules).cache(model_config.num_layers)
    row_shard = cache_shardings.end
    cache = _abstract_cache(model_config, batch, cfg.data.seq_len, cache_shardings)
    token = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=row_shard)
    model = Llama(model_config)

    def step(params, token, cache):
        with nn.logical_axis_rules(rules):
            logits, cache = model.apply({"params": params}, token[:, None], cache=cache)
        return jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32), cache.flush()

    fn = jax.jit(step, in_shardings=(pshard, row_shard, cache_shardings), out_shardings=(row_shard, cache_shardings),
                 donate_argnums=(2,))
    mem = Memory(parameters=_shard_bytes(params, pshard), hbm=target.chip.hbm_bytes,
                 kv_cache=2 * _shard_bytes(cache.k, cache_shardings.k))

    def lower():
        with jax.set_mesh(mesh):
            return fn.lower(_with_shardings(params, pshard), token, cache)

    return _compile(lower, mem, margin)


def estimate_gpu(cfg, model_config, target: Target, decode_batch: int, margin: float) -> tuple[Memory, Memory]:
    """No AOT backend for GPUs here: bytes from shapes (FSDP over all GPUs), activations from
    the remat policy. An estimate; compile on the GPU itself for XLA's own numbers."""
    c, n = model_config, target.num_chips
    params = 4 * c.num_params() / n
    opt = 2 * params
    compute = 2 if c.dtype == "bfloat16" else 4
    micro = cfg.global_batch_size // cfg.accumulation_steps
    tokens = micro * cfg.data.seq_len / n  # per GPU per micro-batch
    e, m, h, s = c.hidden_size, c.intermediate_size, c.num_heads, cfg.data.seq_len
    per_layer_full = tokens * (10 * e + 3 * m) * compute + tokens * h * s * 6  # incl. score and prob matrices
    if c.remat_policy == "full":
        acts = c.num_layers * tokens * e * compute + per_layer_full
    else:
        acts = c.num_layers * per_layer_full
    logits = tokens * c.vocab_size * 4 * 3  # float32 logits, log-softmax and its gradient
    grads = params
    train = Memory(parameters=int(params), optimizer_state=int(opt), temporaries=int(acts + logits + grads),
                   hbm=target.chip.hbm_bytes, estimated=True)
    train.total = int(params + opt + grads + acts + logits)
    train.fits = train.total <= train.hbm * (1 - margin)
    kv = 2 * c.num_layers * decode_batch * c.num_kv_heads * s * c.head_dim * compute / n
    gathered = 4 * c.num_params() / c.num_layers  # one layer's weights all-gathered at a time
    decode = Memory(parameters=int(params), kv_cache=int(kv), temporaries=int(gathered), hbm=target.chip.hbm_bytes,
                    estimated=True)
    decode.total = int(params + kv + gathered)
    decode.fits = decode.total <= decode.hbm * (1 - margin)
    return train, decode


def analytics(cfg, model_config, target: Target, decode: Memory | None, decode_batch: int) -> dict[str, float]:
    """Model FLOPs per step (MaxText's count) and the step time they imply at 50% MFU; the
    decode step's memory-bandwidth roofline (weights and cache read once across the chips)."""
    seq, rows = cfg.data.seq_len, cfg.global_batch_size
    flops = model_config.flops_per_token(seq) * rows * seq
    peak = target.chip.peak_flops * target.num_chips
    step_s = flops / (0.5 * peak)
    out = {"model_flops_per_step": flops, "peak_flops": peak, "step_s_at_50pct_mfu": step_s,
           "tokens_per_s_per_chip_at_50pct_mfu": rows * seq / step_s / target.num_chips}
    if decode is not None:
        read = (decode.parameters + decode.kv_cache) * target.num_chips
        out["decode_bytes_per_step"] = read
        out["decode_roofline_tokens_per_s"] = decode_batch * target.chip.hbm_bandwidth * target.num_chips / read
    return out


def plan(config_path: str | None, target_spec: str, overrides: list[str] = (), decode_batch: int = 0,
         margin: float = 0.1, with_decode: bool = True) -> Plan:
    """Plan one config (plus overrides) for one target."""
    from selfrag_jax.training.config import load_config

    cfg = load_config(config_path, list(overrides))
    target = parse_target(target_spec)
    model_config = plan_model_config(cfg)
    model = {"params": model_config.num_params(), "layers": model_config.num_layers,
             "hidden": model_config.hidden_size, "vocab": model_config.vocab_size, "seq_len": cfg.data.seq_len,
             "global_batch": cfg.global_batch_size, "accumulation": cfg.accumulation_steps,
             "remat": model_config.remat_policy, "dtype": model_config.dtype}
    if target.chip.kind == "gpu":
        from selfrag_jax.sharding import parse_mesh_spec

        mesh = parse_mesh_spec(cfg.mesh, target.num_chips)
        batch = decode_batch or mesh["data"] * mesh["fsdp"]
        train, decode = estimate_gpu(cfg, model_config, target, batch, margin)
        decode = decode if with_decode else None
    else:
        train, mesh = plan_train(cfg, model_config, target, margin)
        batch = decode_batch or mesh["data"] * mesh["fsdp"]
        decode = plan_decode(cfg, model_config, target, batch, margin) if with_decode else None
    model["decode_batch"] = batch
    return Plan(str(config_path), target.spec, target.describe(), target.num_chips, mesh, model, train, decode,
                analytics(cfg, model_config, target, decode, batch), margin, list(overrides))


# --------------------------------------------------------------------------------------
# Planning Self-RAG decoding: the engine's own programs (serving configs)
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServeConfig:
    """A serving config: a YAML file with a top-level `serve:` section of these fields."""

    model: str = "selfrag-7b"  # a model preset, or a model folder whose config gives the shape
    mesh: str = "1,1,-1"  # data, fsdp, tensor, as `generate --mesh`
    dtype: str = "bfloat16"  # parameters and KV cache (`generate --dtype`)
    questions: int = 8  # questions per engine call (`generate --batch-size`)
    ndocs: int = 5  # passages per question (K)
    prompt_tokens: int = 128  # the longest question prompt
    passage_tokens: int = 192  # the longest passage suffix
    max_new_tokens: int = 100

    @classmethod
    def load(cls, path: str, overrides: list[str] = ()) -> "ServeConfig":
        import yaml

        raw = (yaml.safe_load(Path(path).read_text()) or {}).get("serve")
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: no `serve:` section (a serving config)")
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        for item in overrides:
            key, sep, value = item.partition("=")
            if not sep or not key.startswith("serve."):
                raise ValueError(f"override {item!r}: a serving config takes serve.FIELD=VALUE")
            raw[key[len("serve."):]] = yaml.safe_load(value)
        unknown = sorted(set(raw) - set(fields))
        if unknown:
            raise ValueError(f"{path}: serve.{unknown[0]} is not a serving field (one of {', '.join(fields)})")
        config = cls(**{k: str(v) if fields[k] == "str" else v for k, v in raw.items()})
        for name in ("questions", "ndocs", "prompt_tokens", "passage_tokens", "max_new_tokens"):
            if not isinstance(getattr(config, name), int) or getattr(config, name) < 1:
                raise ValueError(f"{path}: serve.{name} must be a whole number of at least 1")
        return config


def is_serve_config(path: str | None) -> bool:
    import yaml

    return bool(path) and Path(path).is_file() and isinstance(
        (yaml.safe_load(Path(path).read_text()) or {}).get("serve"), dict)


def serve_model_config(serve: ServeConfig):
    from selfrag_jax.models.config import PRESETS, LlamaConfig, from_hf_dict, preset

    folder = Path(serve.model)
    if serve.model in PRESETS:
        config = preset(serve.model)
    elif (folder / "model_config.json").exists():
        config = LlamaConfig.load(folder / "model_config.json")
    elif (folder / "config.json").exists():
        config = from_hf_dict(json.loads((folder / "config.json").read_text()), str(folder / "config.json"))
    else:
        raise ValueError(f"serve.model={serve.model!r} is neither a preset ({', '.join(PRESETS)}) nor a model folder")
    return config.replace(dtype=serve.dtype, param_dtype=serve.dtype, scan_layers=True, remat_policy="none")


@dataclass
class ServePlan:
    config: str
    target: str
    description: str
    serve: dict[str, Any]
    mesh: dict[str, int]
    programs: dict[str, Memory]  # prefill and decode (suffix prefill + segment loop) at serve.questions
    largest_questions: int  # the largest question batch that fits (0: not even one)
    tried: dict[int, bool]  # questions -> fits
    analytics: dict[str, float]
    margin: float

    @property
    def fits(self) -> bool:
        return all(m.fits for m in self.programs.values())


def _serve_shapes(serve: ServeConfig, rows) -> dict[str, int]:
    """Rows and lengths the engine pads one call of `serve.questions` questions to."""
    from selfrag_jax.inference.engine import bucket_length
    from selfrag_jax.inference.selfrag import PASSAGE_MARKERS

    q = serve.questions
    return {"context_rows": rows(q), "context_len": bucket_length(serve.prompt_tokens),
            "candidate_rows": rows(q * serve.ndocs), "suffix_len": bucket_length(serve.passage_tokens + PASSAGE_MARKERS)}


def _kv_shape(config, rows: int, length: int) -> tuple[int, ...]:
    """One layer's buffer of a KV cache (models.llama.KVCache)."""
    return rows, config.num_kv_heads, length, config.head_dim


def _abstract_cache(config, rows: int, length: int, shardings):
    """An abstract KVCache of `rows` x `length` slots placed by `shardings` (`Placement.cache`)."""
    import jax
    import jax.numpy as jnp

    from selfrag_jax.models.llama import KVCache

    kv = tuple(jax.ShapeDtypeStruct(_kv_shape(config, rows, length), jnp.dtype(config.dtype), sharding=s)
               for s in shardings.k)
    return KVCache(kv, kv, jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=shardings.end))


def _kv_bytes(config, rows: int, length: int) -> int:
    """Keys and values of a KV cache, all chips together."""
    import jax.numpy as jnp

    return 2 * config.num_layers * math.prod(_kv_shape(config, rows, length)) * jnp.dtype(config.dtype).itemsize


def plan_serve_programs(serve: ServeConfig, model_config, target: Target, margin: float) -> tuple[dict[str, Memory], dict]:
    """AOT-compile the engine's prefill and decode programs (`Engine._prefill`, `Engine._decode`)
    for `serve.questions` questions on `target`: per-chip memory of each, and the mesh."""
    import jax
    import jax.numpy as jnp

    from selfrag_jax import sharding
    from selfrag_jax.inference.engine import ControlIds, Engine, Placement
    from selfrag_jax.models.llama import abstract_params

    placement = Placement(sharding.make_mesh(serve.mesh, target_devices(target)))
    model_config = model_config.replace(scan_layers=False)  # the layout decoding runs
    abstract, _ = abstract_params(model_config)
    pshard = placement.params(model_config)
    params = _with_shardings(abstract, pshard)
    engine = Engine(params, model_config, ControlIds.appended(model_config.vocab_size), serve.max_new_tokens,
                    placement)
    shapes = _serve_shapes(serve, engine.bucket_rows)
    rep = placement.replicated

    def arg(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rep)

    cr, cl, kr, sl = shapes["context_rows"], shapes["context_len"], shapes["candidate_rows"], shapes["suffix_len"]

    cache_s = placement.cache(model_config.num_layers)
    ctx_cache = _abstract_cache(model_config, cr, cl, cache_s)
    cand_cache = _abstract_cache(model_config, kr, cl + sl + serve.max_new_tokens, cache_s)
    param_bytes = _shard_bytes(abstract, pshard)
    ctx_kv = 2 * _shard_bytes(ctx_cache.k, cache_s.k)  # per chip, as the rules split it
    cand_kv = 2 * _shard_bytes(cand_cache.k, cache_s.k)
    programs = {}
    for name, lower in (("prefill", lambda: engine._prefill.lower(params, arg(cr, cl), arg(cr))),
                        ("decode", lambda: engine._decode.lower(params, ctx_cache, arg(kr), arg(kr, sl), arg(kr), arg(kr)))):
        mem = Memory(parameters=param_bytes, kv_cache=ctx_kv + (cand_kv if name == "decode" else 0),
                     hbm=target.chip.hbm_bytes)

        def scoped(lower=lower):
            with placement.scope():
                return lower()

        programs[name] = _compile(scoped, mem, margin)
    return programs, {"mesh": dict(placement.mesh.shape), **shapes}


def estimate_serve_gpu(serve: ServeConfig, model_config, target: Target, margin: float) -> tuple[dict[str, Memory], dict]:
    """GPUs: parameters, both KV caches and the float32 logits of every candidate row, from shapes."""
    import jax.numpy as jnp

    from selfrag_jax.inference.engine import bucket_rows
    from selfrag_jax.sharding import parse_mesh_spec

    mesh = parse_mesh_spec(serve.mesh, target.num_chips)
    shapes = _serve_shapes(serve, lambda n: bucket_rows(n, mesh["data"] * mesh["fsdp"]))
    n = target.num_chips
    params = model_config.num_params() * jnp.dtype(model_config.param_dtype).itemsize / n
    ctx_kv = _kv_bytes(model_config, shapes["context_rows"], shapes["context_len"]) / n
    cand_kv = _kv_bytes(model_config, shapes["candidate_rows"],
                        shapes["context_len"] + shapes["suffix_len"] + serve.max_new_tokens) / n
    logits = 3 * shapes["candidate_rows"] * model_config.vocab_size * 4 / n  # logits, log-softmax, probabilities
    programs = {}
    for name, kv in (("prefill", ctx_kv), ("decode", ctx_kv + cand_kv)):
        mem = Memory(parameters=int(params), kv_cache=int(kv), temporaries=int(logits), hbm=target.chip.hbm_bytes,
                     estimated=True)
        mem.total = int(params + kv + logits)
        mem.fits = mem.total <= mem.hbm * (1 - margin)
        programs[name] = mem
    return programs, {"mesh": mesh, **shapes}


def plan_serve(config_path: str, target_spec: str, overrides: list[str] = (), margin: float = 0.1,
               search: bool = True, max_compiles: int = 12) -> ServePlan:
    """Plan a serving config on a target; then search the largest question batch that fits
    (doubling or halving, then bisecting), compiling each (TPU) or estimating it (GPU)."""
    serve = ServeConfig.load(config_path, list(overrides))
    target = parse_target(target_spec)
    model_config = serve_model_config(serve)
    planner = estimate_serve_gpu if target.chip.kind == "gpu" else plan_serve_programs
    programs, info = planner(serve, model_config, target, margin)
    tried = {serve.questions: all(m.fits for m in programs.values())}

    def fits(q: int) -> bool:
        if q not in tried:
            tried[q] = all(m.fits for m in planner(dataclasses.replace(serve, questions=q), model_config, target,
                                                   margin)[0].values())
        return tried[q]

    # Double (or halve) until the answer changes, then bisect to within an eighth.
    q, first = serve.questions, tried[serve.questions]
    while search and len(tried) < max_compiles:
        q = q * 2 if first else q // 2
        if q < 1 or fits(q) != first:
            break
    lo = max((k for k, ok in tried.items() if ok), default=0)
    hi = min((k for k, ok in tried.items() if not ok), default=0)
    while search and lo and hi > lo + max(1, lo // 8) and len(tried) < max_compiles:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    largest = max((k for k, ok in tried.items() if ok), default=0)
    # Per decode step the weights and every candidate row's whole cache are read once.
    read = programs["decode"].parameters * target.num_chips + _kv_bytes(
        model_config, info["candidate_rows"], info["context_len"] + info["suffix_len"] + serve.max_new_tokens)
    analytics = {"decode_bytes_per_step": read, "candidate_rows": info["candidate_rows"],
                 "decode_roofline_tokens_per_s": info["candidate_rows"] * target.chip.hbm_bandwidth * target.num_chips / read}
    return ServePlan(str(config_path), target.spec, target.describe(), dataclasses.asdict(serve), info.pop("mesh"),
                     programs, largest, tried, {**analytics, **info}, margin)


def serve_table(p: ServePlan) -> str:
    s, a = p.serve, p.analytics
    lines = [f"plan {p.config} on {p.description}",
             f"serving {s['model']} in {s['dtype']}: {s['questions']} questions x {s['ndocs']} passages "
             f"({a['context_rows']} context rows x {a['context_len']}, {a['candidate_rows']} candidate rows x "
             f"{a['suffix_len']} + {s['max_new_tokens']} new); mesh " + " ".join(f"{k}={v}" for k, v in p.mesh.items())]
    rows = [("parameters", "parameters"), ("KV cache", "kv_cache"), ("temporaries", "temporaries"), ("total", "total")]
    lines.append(f"{'per chip':24s}" + "".join(f"{name:>16s}" for name in p.programs))
    for label, key in rows:
        lines.append(f"{label:24s}" + "".join(f"{_gib(getattr(m, key)):>16s}" for m in p.programs.values()))
    est = any(m.estimated for m in p.programs.values())
    lines.append(f"{'fits (' + str(round(p.margin * 100)) + '% margin)':24s}"
                 + "".join(f"{('yes' if m.fits else 'NO'):>16s}" for m in p.programs.values())
                 + ("   (analytic estimate: no ahead-of-time GPU backend here)" if est else ""))
    for m in p.programs.values():
        if m.error:
            lines.append(f"compiler: {m.error}")
    lines.append("question batches tried: " + ", ".join(f"{q} {'fits' if ok else 'does not fit'}"
                                                         for q, ok in sorted(p.tried.items()))
                 + f"; the largest that fits: {'at least ' if all(p.tried.values()) else ''}{p.largest_questions}")
    lines.append(f"decode roofline: {a['decode_roofline_tokens_per_s']:.0f} tokens/s "
                 f"({a['decode_bytes_per_step'] / 1e9:.1f} GB of weights and KV cache read per step)")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# Suggestions: what would make it fit
# --------------------------------------------------------------------------------------
def candidate_changes(cfg, target: Target, model_config) -> list[tuple[str, list[str]]]:
    """Cumulative changes, cheapest in speed first: full remat, FSDP over every chip, halved
    micro-batches down to one sequence per device group, then 2x and 4x the chips."""
    from selfrag_jax.sharding import parse_mesh_spec

    out: list[tuple[str, list[str]]] = []
    changes: list[str] = []
    if model_config.remat_policy != "full":
        changes = changes + ["model.overrides.remat_policy=full"]
        out.append(("remat_policy=full", changes))
    mesh = parse_mesh_spec(cfg.mesh, target.num_chips)
    if mesh["fsdp"] != target.num_chips:
        changes = changes + ["mesh=1,-1,1"]
        out.append(("FSDP over all chips (mesh=1,-1,1)", changes))
    groups = target.num_chips
    micro = cfg.global_batch_size // cfg.accumulation_steps
    base = list(changes)
    while micro // 2 >= groups and (micro // 2) % groups == 0:
        micro //= 2
        changes = base + [f"micro_batch_size={micro}"]
        out.append((f"micro_batch_size={micro} ({cfg.global_batch_size // micro} accumulation steps)", changes))
    for factor in (2, 4):  # same sequences per chip per micro-step as the last change tried
        bigger = target.scaled(factor)
        keep = [c for c in changes if not c.startswith("micro_batch_size=")]
        scaled = micro * factor
        if scaled < cfg.global_batch_size and cfg.global_batch_size % scaled == 0:
            keep.append(f"micro_batch_size={scaled}")
        if cfg.global_batch_size % bigger.num_chips == 0:
            out.append((f"a bigger slice: {bigger.spec}", keep + [f"@{bigger.spec}"]))
    return out


def suggest(config_path: str | None, target_spec: str, overrides: list[str], first: Plan, decode_batch: int,
            margin: float, max_tries: int = 6, log=print) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """Re-plan the candidate changes in order: (the first that fits or None, what was tried)."""
    from selfrag_jax.training.config import load_config

    cfg = load_config(config_path, list(overrides))
    target = parse_target(target_spec)
    state_too_big = (first.train.error or "").startswith("parameters, gradients")
    tried: list[dict[str, Any]] = []
    for label, changes in candidate_changes(cfg, target, plan_model_config(cfg)):
        spec = next((c[1:] for c in changes if c.startswith("@")), target_spec)
        extra = [c for c in changes if not c.startswith("@")]
        if state_too_big and spec == target_spec:
            continue  # no change of activations helps when the state alone overflows: more chips
        if len(tried) >= max_tries:
            break
        log(f"  trying {label} ...")
        try:
            attempt = plan(config_path, spec, [*overrides, *extra], decode_batch if spec == target_spec else 0,
                           margin, with_decode=first.decode is not None)
        except ValueError as err:  # e.g. a batch that no longer divides: skip this candidate
            log(f"  {label}: {err}")
            tried.append({"change": label, "target": spec, "error": str(err)})
            continue
        tried.append({"change": label, "target": spec, "train_total": attempt.train.total, "fits": attempt.fits,
                      "error": attempt.train.error})
        log(f"  {label}: train {_gib(attempt.train.total)} per chip -> {'fits' if attempt.fits else 'does not fit'}")
        if attempt.fits:
            return {"change": label, "target": spec, "overrides": extra, "plan": to_dict(attempt)}, tried
    return None, tried


# --------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------
def to_dict(p: Plan) -> dict[str, Any]:
    out = dataclasses.asdict(p)
    out["fits"] = p.fits
    return out


def table(p: Plan) -> str:
    m = p.model
    lines = [
        f"plan {p.config} on {p.description}",
        f"model: {m['params'] / 1e9:.2f}B params, {m['layers']} layers, seq {m['seq_len']}, global batch "
        f"{m['global_batch']} (accumulation {m['accumulation']}), remat {m['remat']}, {m['dtype']} compute; "
        f"mesh " + " ".join(f"{k}={v}" for k, v in p.mesh.items()),
    ]
    cols = [("train step", p.train)] + ([(f"decode step (batch {m['decode_batch']})", p.decode)] if p.decode else [])
    rows = [("parameters", "parameters"), ("optimizer state", "optimizer_state"), ("KV cache", "kv_cache"),
            ("arguments", "arguments"), ("outputs", "outputs"), ("aliased (donated)", "aliased"),
            ("temporaries", "temporaries"), ("generated code", "generated_code"), ("total", "total")]
    lines.append(f"{'per chip':<20}" + "".join(f"{name:>26}" for name, _ in cols))
    for label, key in rows:
        values = [getattr(mem, key) for _, mem in cols]
        if not any(values):
            continue
        lines.append(f"{label:<20}" + "".join(f"{_gib(v) if v else '-':>26}" for v in values))
    lines.append(f"{'HBM':<20}" + "".join(f"{_gib(mem.hbm):>26}" for _, mem in cols))
    verdict = lambda mem: "yes" if mem.fits else "NO"  # noqa: E731
    lines.append(f"{f'fits ({p.margin:.0%} margin)':<20}" + "".join(f"{verdict(mem):>26}" for _, mem in cols))
    for name, mem in cols:
        if mem.error:
            lines.append(f"{name}: {mem.error}")
        if mem.estimated:
            lines.append(f"{name}: analytic estimate (no ahead-of-time compiler for GPUs on this machine)")
    a = p.analytics
    lines.append(f"model FLOPs per step {a['model_flops_per_step']:.3g}; at 50% MFU a step takes "
                 f"{a['step_s_at_50pct_mfu']:.2f} s ({a['tokens_per_s_per_chip_at_50pct_mfu']:.0f} tokens/s per chip)")
    if "decode_roofline_tokens_per_s" in a:
        lines.append(f"decode roofline: {a['decode_roofline_tokens_per_s']:.0f} tokens/s "
                     f"({a['decode_bytes_per_step'] / 1e9:.1f} GB of weights and KV cache read per step)")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = " ".join(__doc__.split("\n\n")[1:3]).replace("\n", " ").split(" Exit status")[0]
    parser.epilog = "exit status: 0 fits, 1 does not fit (see the suggested change), 2 bad input"
    parser.add_argument("config", help="training YAML (e.g. configs/tpu/generator_7b_v5p-32.yaml), or a serving "
                                       "YAML with a `serve:` section (configs/serve/): the engine's programs")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, as for train "
                                                                          "(serve.questions=16 for a serving YAML)")
    parser.add_argument("--mesh", required=True, metavar="SPEC", help=SPEC_HELP)
    parser.add_argument("--decode-batch", type=int, default=0,
                        help="rows of the decode step (default: one per data x fsdp device group)")
    parser.add_argument("--margin", type=float, default=0.1, help="share of HBM kept free [0.1]")
    parser.add_argument("--no-decode", action="store_true", help="plan the train step only")
    parser.add_argument("--no-suggest", action="store_true", help="do not re-plan changes when it does not fit "
                                                                  "(serving: do not search the largest question batch)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.margin < 1:
        raise ValueError(f"--margin {args.margin} must be in [0, 1)")
    parse_target(args.mesh)  # bad specs fail before anything is imported or compiled
    if is_serve_config(args.config):
        try:
            served = plan_serve(args.config, args.mesh, args.overrides, args.margin, search=not args.no_suggest)
        except RuntimeError as err:
            raise ValueError(str(err)) from None
        print(json.dumps({**dataclasses.asdict(served), "fits": served.fits}, indent=2) if args.json
              else serve_table(served))
        return 0 if served.fits else 1
    log = (lambda *_: None) if args.json else print
    try:
        report = plan(args.config, args.mesh, args.overrides, args.decode_batch, args.margin, not args.no_decode)
    except RuntimeError as err:
        raise ValueError(str(err)) from None
    out = to_dict(report)
    if not args.json:
        print(table(report))
    if not report.fits and not args.no_suggest:
        log("does not fit; re-planning changes that could make it fit:")
        out["suggestion"], out["tried"] = suggest(args.config, args.mesh, args.overrides, report, args.decode_batch,
                                                  args.margin, log=log)
        if out["suggestion"]:
            s = out["suggestion"]
            log(f"suggested change: {s['change']} (total {_gib(s['plan']['train']['total'])} per chip on "
                f"{s['target']}): {' '.join(s['overrides'])}")
        else:
            log("no tried change fits; use a bigger slice or a smaller model")
    if args.json:
        print(json.dumps(out, indent=2))
    return 0 if report.fits else 1
