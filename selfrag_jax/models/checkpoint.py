"""Model checkpoints of this project, and `load_model` for anything a user may point at.

A model checkpoint folder holds:
    model_config.json   the LlamaConfig
    params/             Orbax (restorable onto any mesh: pass shardings)
    tokenizer/          the Self-RAG tokenizer (reflection tokens included)
    hf_meta.json        optional: the original HF config and tensor dtypes, for lossless export
Training step folders (selfrag_jax.training) contain the same files next to the optimizer
state, so `load_model` accepts a model folder, a training step folder, a training run folder
(latest step) or a Hugging Face Llama folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from selfrag_jax.models.config import LlamaConfig
from selfrag_jax.models.params import to_layout
from selfrag_jax.utils import atomic_dir


def save_params(path: str | os.PathLike, params: Any) -> None:
    import orbax.checkpoint as ocp

    ckptr = ocp.StandardCheckpointer()
    ckptr.save(Path(path).absolute(), params)
    ckptr.wait_until_finished()


def restore_params(path: str | os.PathLike, config: LlamaConfig, shardings: Any = None) -> Any:
    """Restore parameters into the layout `config` asks for, placed by `shardings` (or host)."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    ckptr = ocp.StandardCheckpointer()
    meta = ckptr.metadata(path)
    tree = getattr(meta, "item_metadata", meta)
    stored_scanned = "layers" in tree
    if stored_scanned == config.scan_layers and shardings is not None:
        from selfrag_jax.models.llama import abstract_params

        abstract, _ = abstract_params(config)
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
        return ckptr.restore(path, target)
    # Into host memory, whatever mesh wrote it: without a target Orbax restores the saved
    # topology and fails when the device count differs (a checkpoint from a pod or a
    # two-device CPU run, read by a one-device process); the arrays go to numpy next anyway.
    try:
        host = jax.devices("cpu")[0]
    except RuntimeError:  # JAX_PLATFORMS names only an accelerator: no CPU backend to land on
        host = jax.devices()[0]
    here = jax.sharding.SingleDeviceSharding(host)
    params = ckptr.restore(path, jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=here), tree))
    dtype = jax.numpy.dtype(config.param_dtype)
    params = to_layout(jax.tree.map(lambda x: np.asarray(x).astype(dtype), params), config)
    return jax.device_put(params, shardings) if shardings is not None else params


def save_model(out_dir: str | os.PathLike, params: Any, config: LlamaConfig, tokenizer=None,
               hf_meta: dict | None = None, tokenizer_files: str | os.PathLike | None = None) -> Path:
    """Write a model checkpoint folder atomically (a crash leaves no half-written model).

    `tokenizer` (a SelfRAGTokenizer) is saved as is; `tokenizer_files` copies a folder's
    tokenizer files untouched instead (lossless conversion)."""
    with atomic_dir(out_dir) as tmp:
        config.save(tmp / "model_config.json")
        save_params(tmp / "params", params)
        if tokenizer is not None:
            tokenizer.save(tmp / "tokenizer")
        elif tokenizer_files is not None:
            from selfrag_jax.models.hf import copy_tokenizer_files

            copy_tokenizer_files(tokenizer_files, tmp / "tokenizer")
        if hf_meta is not None:
            (tmp / "hf_meta.json").write_text(json.dumps(hf_meta, indent=1))
    return Path(out_dir)


def is_complete_step(step_dir: Path) -> bool:
    """A training step folder that Orbax finished writing (every item committed)."""
    return (step_dir.name.isdigit() and (step_dir / "_CHECKPOINT_METADATA").exists()
            and all((step_dir / item / "commit_success.txt").exists() for item in ("params", "meta")))


def complete_steps(checkpoints_dir: Path) -> list[int]:
    if not checkpoints_dir.is_dir():
        return []
    return sorted(int(p.name) for p in checkpoints_dir.iterdir() if is_complete_step(p))


def resolve_model_dir(path: str | os.PathLike) -> Path:
    """A model folder, a training step folder, or a run folder (its latest complete step)."""
    path = Path(path)
    if (path / "model_config.json").exists() and (path / "params").exists() or is_complete_step(path):
        return path
    steps = complete_steps(path / "checkpoints")
    if steps:
        return path / "checkpoints" / str(steps[-1])
    raise FileNotFoundError(f"{path}: not a selfrag-jax model checkpoint or Hugging Face Llama folder "
                            "(no model_config.json or config.json + safetensors)")


def _load_tokenizer(folder: Path, step: bool):
    """The tokenizer of a model folder, or of a training step (JSON files in its metadata)."""
    import tempfile

    from selfrag_jax.tokenizer import SelfRAGTokenizer

    if not step:
        return SelfRAGTokenizer.from_pretrained(folder / "tokenizer") if (folder / "tokenizer").exists() else None
    files = json.loads((folder / "meta" / "metadata").read_text()).get("tokenizer")
    if not files:
        return None
    with tempfile.TemporaryDirectory(prefix="selfrag-tok-") as tmp:
        for name, content in files.items():
            (Path(tmp) / name).write_text(json.dumps(content))
        return SelfRAGTokenizer.from_pretrained(tmp)


def load_model(path: str | os.PathLike, scan_layers: bool | None = None, shardings: Any = None,
               add_control_tokens: bool = True, dtype: str | None = None, **config_overrides):
    """(config, params, tokenizer, hf_meta) from a checkpoint of ours, a HF Llama folder or a
    Llama-architecture GGUF file.

    With `add_control_tokens` the tokenizer gains the reflection tokens if it lacks them and
    the embedding grows to match (new rows at the mean of the old ones); conversion turns
    it off to stay lossless. `dtype` stores the parameters (and computes) in that dtype, for
    inference. `shardings` is a tree of shardings, or a function of the final config that
    returns one (`Placement.params`): parameters then load tensor by tensor into them, in
    their dtype, never whole on one device or on the host (except where the vocabulary grows,
    which needs the whole embedding)."""
    from selfrag_jax.models.gguf import GGUFModel, is_gguf
    from selfrag_jax.models.hf import is_hf_folder, open_source, read_host, read_placed
    from selfrag_jax.models.params import resize_vocab
    from selfrag_jax.tokenizer import SelfRAGTokenizer

    path = Path(path)
    overrides = dict(config_overrides)
    if scan_layers is not None:
        overrides["scan_layers"] = scan_layers
    if dtype is not None:
        overrides.update(dtype=dtype, param_dtype=dtype)
    if is_hf_folder(path) or is_gguf(path):
        source = open_source(path)
        config = source.config(**{"scan_layers": True, **overrides})
        if not add_control_tokens:
            tokenizer = None
        elif isinstance(source.reader, GGUFModel):
            tokenizer = SelfRAGTokenizer(source.reader.tokenizer())
        else:
            tokenizer = SelfRAGTokenizer.from_pretrained(path) if _has_tokenizer(path) else None
        grow = tokenizer is not None and len(tokenizer) > config.vocab_size
        if shardings is not None and not grow:
            params, meta = read_placed(source, config, _resolve(shardings, config))
            return config, params, tokenizer, meta
        params, meta = read_host(source, config)
        if grow:
            params, config = resize_vocab(params, config, len(tokenizer))
        return config, _place(params, config, shardings), tokenizer, meta
    folder = resolve_model_dir(path)
    step = is_complete_step(folder)
    if step:
        config = LlamaConfig.from_dict(json.loads((folder / "meta" / "metadata").read_text())["model_config"],
                                       where=str(folder / "meta"))
    else:
        config = LlamaConfig.load(folder / "model_config.json")
    config = config.replace(**overrides)
    tokenizer = _load_tokenizer(folder, step) if add_control_tokens else None
    if tokenizer is not None and len(tokenizer) > config.vocab_size:
        params, config = resize_vocab(restore_params(folder / "params", config), config, len(tokenizer))
        params = _place(params, config, shardings)
    else:
        params = restore_params(folder / "params", config, _resolve(shardings, config))
    meta_path = folder / "hf_meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else None
    return config, params, tokenizer, meta


def _resolve(shardings: Any, config: LlamaConfig) -> Any:
    return shardings(config) if callable(shardings) else shardings


def _place(params: Any, config: LlamaConfig, shardings: Any) -> Any:
    """Host parameters in the config's parameter dtype, on their shardings when given."""
    params = jax.tree.map(lambda x: np.asarray(x).astype(jax.numpy.dtype(config.param_dtype)), params)
    return jax.device_put(params, _resolve(shardings, config)) if shardings is not None else params


def _has_tokenizer(path: Path) -> bool:
    return (path / "tokenizer.json").exists() or (path / "tokenizer.model").exists()
