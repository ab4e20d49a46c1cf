"""Hugging Face Llama folders (and GGUF files, read as one) <-> this project's parameters,
through one name table.

HF linear weights are `[out, in]`; ours are `[in..., out...]` (e.g. wq `[embed, heads,
head_dim]`), so every matrix converts as `hf.T.reshape(ours)` and back as
`ours.reshape(hf_shape[::-1]).T`. RoPE keeps HF's rotate-half layout, so q/k need no
permutation. Tensors are read lazily from (sharded) safetensors and keep their dtype
recorded, so an export reproduces the original tensors bit for bit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from selfrag_jax.models.config import LlamaConfig, from_hf_dict, to_hf_dict
from selfrag_jax.models.params import to_layout

# (HF name, our path inside a layer or at the top, kind). "{i}" is the layer index.
TOP_TABLE = (
    ("model.embed_tokens.weight", ("embedding",), "copy"),
    ("model.norm.weight", ("final_norm", "scale"), "copy"),
    ("lm_head.weight", ("lm_head",), "linear"),
)
LAYER_TABLE = (
    ("model.layers.{i}.self_attn.q_proj.weight", ("attn", "wq"), "linear"),
    ("model.layers.{i}.self_attn.k_proj.weight", ("attn", "wk"), "linear"),
    ("model.layers.{i}.self_attn.v_proj.weight", ("attn", "wv"), "linear"),
    ("model.layers.{i}.self_attn.o_proj.weight", ("attn", "wo"), "linear"),
    ("model.layers.{i}.mlp.gate_proj.weight", ("mlp", "gate"), "linear"),
    ("model.layers.{i}.mlp.up_proj.weight", ("mlp", "up"), "linear"),
    ("model.layers.{i}.mlp.down_proj.weight", ("mlp", "down"), "linear"),
    ("model.layers.{i}.input_layernorm.weight", ("attn_norm", "scale"), "copy"),
    ("model.layers.{i}.post_attention_layernorm.weight", ("mlp_norm", "scale"), "copy"),
)
# Buffers some exports carry that hold no parameters.
IGNORED_TENSORS = ("rotary_emb.inv_freq",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "added_tokens.json", "chat_template.jinja")
EXTRA_FILES = ("generation_config.json",)
SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def our_shapes(config: LlamaConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Shape of every per-layer and top-level tensor in our (unscanned) layout."""
    e, m, h, kv, d, v = (config.hidden_size, config.intermediate_size, config.num_heads, config.num_kv_heads,
                         config.head_dim, config.vocab_size)
    return {
        ("embedding",): (v, e), ("final_norm", "scale"): (e,), ("lm_head",): (e, v),
        ("attn", "wq"): (e, h, d), ("attn", "wk"): (e, kv, d), ("attn", "wv"): (e, kv, d),
        ("attn", "wo"): (h, d, e), ("mlp", "gate"): (e, m), ("mlp", "up"): (e, m), ("mlp", "down"): (m, e),
        ("attn_norm", "scale"): (e,), ("mlp_norm", "scale"): (e,),
    }


def name_table(config: LlamaConfig) -> Iterator[tuple[str, tuple[str, ...], str, tuple[int, ...]]]:
    """(HF name, full path in the unscanned tree, kind, our shape) for every tensor."""
    shapes = our_shapes(config)
    for hf_name, path, kind in TOP_TABLE:
        if path == ("lm_head",) and config.tie_word_embeddings:
            continue
        yield hf_name, path, kind, shapes[path]
    for i in range(config.num_layers):
        for hf_name, path, kind in LAYER_TABLE:
            yield hf_name.format(i=i), (f"layers_{i}", *path), kind, shapes[path]


# --------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------
class SafetensorsReader:
    """Lazy access to the tensors of a folder with one or several safetensors files."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self.folder = folder
        index = folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        else:
            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{folder}: no *.safetensors files (and no model.safetensors.index.json)")
            weight_map = {}
            for f in files:
                with safe_open(f, framework="numpy") as handle:
                    weight_map.update({k: f.name for k in handle.keys()})
        self.weight_map: dict[str, str] = weight_map
        self._handles: dict[str, Any] = {}
        self._open = safe_open

    def names(self) -> list[str]:
        return list(self.weight_map)

    def _handle(self, name: str):
        file = self.weight_map[name]
        if file not in self._handles:
            path = self.folder / file
            if not path.exists():
                raise FileNotFoundError(f"{path}: listed in the safetensors index but missing")
            self._handles[file] = self._open(path, framework="numpy")
        return self._handles[file]

    def get(self, name: str) -> np.ndarray:
        return self._handle(name).get_tensor(name)

    def shape_dtype(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, numpy dtype name) read from the header only."""
        part = self._handle(name).get_slice(name)
        return tuple(part.get_shape()), SAFETENSORS_DTYPES.get(part.get_dtype(), part.get_dtype().lower())

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """Only the part `index` of a tensor (no more of the file is read)."""
        return self._handle(name).get_slice(name)[index]


class TorchBinReader:
    """The same access to `pytorch_model.bin` (or its shards and index), read without torch
    (`models.torch_zip`); one shard is held at a time."""

    def __init__(self, folder: Path):
        self.folder = folder
        index = folder / "pytorch_model.bin.index.json"
        if index.exists():
            self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        else:
            self.weight_map = {name: "pytorch_model.bin" for name in self._load(folder / "pytorch_model.bin")}
        self._cached: tuple[str, dict[str, np.ndarray]] | None = None
        self._headers: dict[str, tuple[tuple[int, ...], str]] = {}

    def _load(self, path: Path) -> dict[str, np.ndarray]:
        from selfrag_jax.models.torch_zip import load_torch_zip

        if not path.exists():
            raise FileNotFoundError(f"{path}: listed in the checkpoint index but missing")
        return load_torch_zip(path)

    def names(self) -> list[str]:
        return list(self.weight_map)

    def get(self, name: str) -> np.ndarray:
        file = self.weight_map[name]
        if self._cached is None or self._cached[0] != file:
            self._cached = (file, self._load(self.folder / file))
            self._headers.update({k: (tuple(v.shape), str(v.dtype)) for k, v in self._cached[1].items()})
        return self._cached[1][name]

    def shape_dtype(self, name: str) -> tuple[tuple[int, ...], str]:
        """A pickle has no header: the first look at a shard records all of its tensors."""
        if name not in self._headers:
            self.get(name)
        return self._headers[name]

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        return self.get(name)[index]


def is_hf_folder(path: str | os.PathLike) -> bool:
    p = Path(path)
    return (p / "config.json").exists() and (any(p.glob("*.safetensors")) or (p / "model.safetensors.index.json").exists()
                                             or (p / "pytorch_model.bin").exists()
                                             or (p / "pytorch_model.bin.index.json").exists())


@dataclass(frozen=True)
class Source:
    """An opened model: a HF Llama folder (safetensors, or PyTorch `.bin` files read without
    torch) or a GGUF file (`models.gguf`, read as the HF folder it would convert to). Opened
    once; the config, the tensors and a GGUF's tokenizer all come from it."""

    path: Path
    hf_config: dict
    reader: Any  # SafetensorsReader | TorchBinReader | GGUFModel
    where: str  # what errors about the config name

    def config(self, **overrides) -> LlamaConfig:
        return from_hf_dict(self.hf_config, where=self.where, **overrides)

    def check_tensors(self, config: LlamaConfig) -> dict[str, str]:
        """Every tensor `config` needs is there with its shape, and nothing else: the HF dtype
        of each (for a lossless export)."""
        available = set(self.reader.names())
        dtypes: dict[str, str] = {}
        for hf_name, path, kind, shape in name_table(config):
            if hf_name not in available:
                raise ValueError(f"{self.path}: tensor {hf_name!r} is missing")
            found, dtypes[hf_name] = self.reader.shape_dtype(hf_name)
            if found != _hf_shape(path, kind, shape):
                raise ValueError(f"{self.path}: tensor {hf_name!r} has shape {found}, "
                                 f"expected {_hf_shape(path, kind, shape)} from {self.where}")
            available.discard(hf_name)
        leftover = sorted(n for n in available if not n.endswith(IGNORED_TENSORS))
        if config.tie_word_embeddings and "lm_head.weight" in leftover:
            leftover.remove("lm_head.weight")  # some tied exports still write it
        if leftover:
            raise ValueError(f"{self.path}: unexpected tensor {leftover[0]!r} (not part of a Llama model)")
        return dtypes

    def meta(self, dtypes: dict[str, str]) -> dict:
        """What an export needs to reproduce the folder: its config, tensor dtypes, extra files
        (a GGUF file has none beside it: its dequantized tensors export as float32)."""
        folder = self.path
        extra = {} if folder.is_file() else {name: json.loads((folder / name).read_text())
                                             for name in EXTRA_FILES if (folder / name).exists()}
        return {"hf_config": self.hf_config, "dtypes": dtypes, "extra": extra}


def open_source(path: str | os.PathLike) -> Source:
    from selfrag_jax.models.gguf import GGUFModel, is_gguf

    path = Path(path)
    if is_gguf(path):
        model = GGUFModel(path)
        return Source(path, model.hf_config, model, str(path))
    config_path = path / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{config_path}: missing (not a Hugging Face model folder)")
    safetensors = any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").exists()
    reader = SafetensorsReader(path) if safetensors else TorchBinReader(path)
    return Source(path, json.loads(config_path.read_text()), reader, str(config_path))


def load_hf(folder: str | os.PathLike, scan_layers: bool = True, **config_overrides):
    """Read a HF Llama folder (or a GGUF file). Returns (config, params as numpy float32,
    metadata for export)."""
    source = open_source(folder)
    config = source.config(scan_layers=scan_layers, **config_overrides)
    return (config, *read_host(source, config))


def read_host(source: Source, config: LlamaConfig) -> tuple[dict[str, Any], dict]:
    """(params as numpy float32 in `config`'s layout, metadata for export)."""
    dtypes = source.check_tensors(config)
    params: dict[str, Any] = {}
    # File by file: a reader that holds one shard at a time then reads each shard once.
    for hf_name, path, kind, shape in sorted(name_table(config), key=lambda e: source.reader.weight_map[e[0]]):
        value = source.reader.get(hf_name).astype(np.float32)
        value = value.T.reshape(shape) if kind == "linear" else value
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return to_layout(params, config), source.meta(dtypes)


def read_placed(source: Source, config: LlamaConfig, shardings: Any) -> tuple[Any, dict]:
    """(params as sharded device arrays of `config.param_dtype`, metadata for export).

    Each device's shard is read from the files on its own (a column or row range of the HF
    matrix) and cast on the way, so a model is never whole on one device, nor in host memory:
    a 13B in bfloat16 loads onto 8 chips of 16 GB."""
    import jax

    from selfrag_jax.models.llama import abstract_params

    dtypes = source.check_tensors(config)
    reader = source.reader
    target = np.dtype(_np_dtype(config.param_dtype))
    kinds = {path: kind for _, path, kind in (*TOP_TABLE, *LAYER_TABLE)}
    abstract, _ = abstract_params(config)

    def leaf(key_path, value, spec):
        keys = tuple(k.key for k in key_path)
        if keys[0] == "layers":  # scanned: [layers, ...] stacked from one HF tensor per layer
            hf_name, path = _hf_name(keys[1:]), keys[1:]

            def shard(index):
                layers = range(*index[0].indices(config.num_layers))
                return np.stack([_read_part(reader, hf_name.format(i=i), kinds[path], path, value.shape[1:],
                                            index[1:], target) for i in layers])
        else:
            layer = keys[0].removeprefix("layers_") if keys[0].startswith("layers_") else None
            path = keys[1:] if layer is not None else keys
            hf_name = _hf_name(path).format(i=layer)

            def shard(index):
                return _read_part(reader, hf_name, kinds[path], path, value.shape, index, target)
        return jax.make_array_from_callback(value.shape, spec, shard)

    return jax.tree_util.tree_map_with_path(leaf, abstract, shardings), source.meta(dtypes)


def _hf_name(path: tuple[str, ...]) -> str:
    return next(name for name, p, _ in (*TOP_TABLE, *LAYER_TABLE) if p == path)


def _read_part(reader: Any, name: str, kind: str, path: tuple[str, ...], shape: tuple[int, ...],
               index: tuple[slice, ...], dtype: np.dtype) -> np.ndarray:
    """Our-layout part `index` of one HF tensor, cast to `dtype`. A linear weight is HF
    `[prod(out dims), prod(in dims)]`: a part whose split dim leads its group is a contiguous
    range of HF rows or columns and is all that is read; any other split reads the group whole."""
    ranges = [s.indices(n)[:2] for s, n in zip(index, shape)]
    if kind == "copy":
        return reader.read(name, tuple(slice(a, b) for a, b in ranges)).astype(dtype)
    n_in = 2 if path[-1] == "wo" else 1
    hf_index, group_shape, post = [], [], []
    for dims, rng in ((shape[n_in:], ranges[n_in:]), (shape[:n_in], ranges[:n_in])):  # HF rows, then columns
        inner = int(np.prod(dims[1:]))
        if all(r == (0, n) for r, n in zip(rng[1:], dims[1:])):
            hf_index.append(slice(rng[0][0] * inner, rng[0][1] * inner))
            group_shape.append((rng[0][1] - rng[0][0], *dims[1:]))
            post.append((slice(None),) * len(dims))
        else:
            hf_index.append(slice(0, int(np.prod(dims))))
            group_shape.append(tuple(dims))
            post.append(tuple(slice(a, b) for a, b in rng))
    part = reader.read(name, tuple(hf_index)).T.reshape(*group_shape[1], *group_shape[0])
    return np.ascontiguousarray(part[post[1] + post[0]]).astype(dtype)


# --------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------
def export_hf(params: dict[str, Any], config: LlamaConfig, out_dir: str | os.PathLike, meta: dict | None = None,
              tokenizer_dir: str | os.PathLike | None = None, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write a HF Llama folder (config.json, safetensors shards + index, tokenizer files).

    Written into a temporary sibling folder and renamed into place, so a crash never leaves
    a half-written model at `out_dir`.
    """
    from safetensors.numpy import save_file

    from selfrag_jax.utils import atomic_dir

    meta = meta or {}
    dtypes = meta.get("dtypes", {})
    flat = to_layout(params, config.replace(scan_layers=False))
    tensors: dict[str, np.ndarray] = {}
    for hf_name, path, kind, shape in name_table(config):
        value = flat
        for key in path:
            value = value[key]
        value = np.asarray(value)
        if kind == "linear":
            value = value.reshape(_hf_shape(path, kind, shape)[::-1]).T
        dtype = dtypes.get(hf_name, "float32")
        tensors[hf_name] = np.ascontiguousarray(value.astype(_np_dtype(dtype)))

    hf_config = dict(meta.get("hf_config") or to_hf_dict(config))
    hf_config["vocab_size"] = config.vocab_size
    with atomic_dir(out_dir) as tmp:
        shards, current, size = [], {}, 0
        for name, value in tensors.items():
            if current and size + value.nbytes > max_shard_bytes:
                shards.append(current)
                current, size = {}, 0
            current[name] = value
            size += value.nbytes
        shards.append(current)
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for n, shard in enumerate(shards, 1):
                file = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / file), metadata={"format": "pt"})
                weight_map.update({name: file for name in shard})
            total = sum(v.nbytes for v in tensors.values())
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        for name, content in meta.get("extra", {}).items():
            (tmp / name).write_text(json.dumps(content, indent=2) + "\n")
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, tmp)


def _hf_shape(path: tuple[str, ...], kind: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """HF `[out, in]` shape of one of our tensors (wo is the one with two input dims)."""
    if kind == "copy":
        return shape
    n_in = 2 if path[-1] == "wo" else 1
    return (int(np.prod(shape[n_in:])), int(np.prod(shape[:n_in])))


def _np_dtype(name: str):
    import ml_dtypes

    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def copy_tokenizer_files(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    import shutil

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)
