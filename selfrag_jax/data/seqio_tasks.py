"""The seqio + tensorflow-datasets path (needs the `data` extra; imports TensorFlow).

- `SelfRAGVocabulary`: a seqio Vocabulary over the project's tokenizer. `structured=True`
  encodes trusted Self-RAG output (reflection-token strings -> their ids); the default
  encodes untrusted text with special-token parsing off.
- `SelfragJsonl`: a TFDS builder over a local JSON-lines file (no download, no network):
  the file's records in file order, validated by records.parse_record, so a bad line fails
  with FILE:LINE. Prepared once per file content under a cache folder.
- `register_tasks`: one seqio Task per TaskSpec (generator; critic per token type) and a
  seqio Mixture with the rates. Their output features are `targets` (BOS prompt target EOS,
  truncated to sequence_length["targets"]) and `loss_weights`, both computed by the same
  `encode.assemble` as the numpy path.
- `seqio_sources`: the tasks' examples as random-access sources for pipeline.DataIterator,
  so shuffling, mixing, sharding and packing are shared with the numpy path and the two
  paths yield identical batches. The examples of a task are held in memory (int32 tokens +
  float32 weights), like seqio's in-memory cache of small datasets.
"""

from __future__ import annotations

import hashlib
import os
import re

import numpy as np
import seqio
import tensorflow as tf
import tensorflow_datasets as tfds

from selfrag_jax import tokens as T

from .encode import Example, MaskConfig, SpecialIds, assemble
from .config import DataConfig, TaskSpec
from .records import iter_records

_TEXT_FIELDS = ("instruction", "input", "output", "id", "type")


class SelfRAGVocabulary(seqio.Vocabulary):
    """seqio view of a SelfRAGTokenizer; reflection tokens are handled by id."""

    def __init__(self, tokenizer, structured: bool = False):
        super().__init__(extra_ids=0)
        self.tokenizer, self.structured = tokenizer, structured

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def bos_id(self) -> int | None:
        return self.tokenizer.bos_id

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id

    @property
    def unk_id(self) -> int | None:
        return self.tokenizer.hf.unk_token_id

    @property
    def _base_vocab_size(self) -> int:
        return len(self.tokenizer)

    def _encode(self, s: str) -> list[int]:
        return self.tokenizer.encode_structured(s) if self.structured else self.tokenizer.encode_text(s)

    def _decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_control=not self.structured)

    def _encode_tf(self, s: tf.Tensor) -> tf.Tensor:
        def enc(b):  # bytes in a graph, a 0-d object array when eager
            b = b.item() if isinstance(b, np.ndarray) else b
            return np.asarray(self._encode(b.decode("utf-8")), np.int32)

        out = tf.numpy_function(enc, [s], tf.int32, stateful=False)
        return tf.ensure_shape(out, [None])

    def _decode_tf(self, ids: tf.Tensor) -> tf.Tensor:
        def dec(a):
            if a.ndim == 1:
                return np.asarray(self._decode(a.tolist()).encode("utf-8"), object)
            return np.asarray([self._decode(r.tolist()).encode("utf-8") for r in a], object)

        return tf.numpy_function(dec, [ids], tf.string, stateful=False)

    def __eq__(self, other) -> bool:
        return (isinstance(other, SelfRAGVocabulary) and other.tokenizer is self.tokenizer
                and other.structured == self.structured)

    def __hash__(self) -> int:
        return hash((id(self.tokenizer), self.structured))


# --- TFDS builder over a local file ----------------------------------------------------
class SelfragJsonlConfig(tfds.core.BuilderConfig):
    def __init__(self, *, path: str, kind: str, digest: str):
        super().__init__(name=f"{kind}_{digest[:16]}", version=tfds.core.Version("1.0.0"),
                         description=f"Self-RAG {kind} records of {path}")
        self.path, self.kind = path, kind


class SelfragJsonl(tfds.core.GeneratorBasedBuilder):
    """Records of one local JSON-lines file, in file order (`line` = 1-based line number)."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self) -> tfds.core.DatasetInfo:
        features = {k: tfds.features.Text() for k in _TEXT_FIELDS}
        features["line"] = tfds.features.Scalar(dtype=np.int64)
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(features),
                                     disable_shuffling=True)

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(self.builder_config.path, self.builder_config.kind)}

    def _generate_examples(self, path: str, kind: str):
        for line, rec in iter_records(path, kind):
            yield line, {**{k: rec[k] for k in _TEXT_FIELDS}, "line": line}


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_data_dir() -> str:
    return os.environ.get("SELFRAG_JAX_TFDS_DIR") or os.path.join(
        os.environ.get("SELFRAG_JAX_CACHE") or os.path.expanduser("~/.cache/selfrag_jax"), "tfds")


def prepare_jsonl(path: str, kind: str, data_dir: str | None = None) -> SelfragJsonl:
    """Builds (once per file content) and returns the TFDS builder of a local file."""
    path = os.path.abspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    config = SelfragJsonlConfig(path=path, kind=kind, digest=_file_digest(path))
    builder = SelfragJsonl(config=config, data_dir=data_dir or default_data_dir())
    tfds.disable_progress_bar()
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(try_download_gcs=False))
    return builder


# --- seqio tasks ---------------------------------------------------------------------------
def _tf_format(template: str, **fields: tf.Tensor) -> tf.Tensor:
    """str.format for the fixed prompt templates of tokens.py, in TF string ops."""
    parts = [p for p in re.split(r"(\{\w+\})", template) if p]
    return tf.strings.join([fields[p[1:-1]] if p.startswith("{") and p.endswith("}") else tf.constant(p) for p in parts])


def _texts_fn(kind: str):
    """Record -> {"prompt", "target"} strings, as encode.generator_texts / critic_texts."""

    @seqio.map_over_dataset
    def fn(ex):
        if kind == "generator":
            prompt = tf.cond(tf.strings.length(ex["input"]) > 0,
                             lambda: _tf_format(T.PROMPT_WITH_INPUT, instruction=ex["instruction"], input=ex["input"]),
                             lambda: _tf_format(T.PROMPT_NO_INPUT, instruction=ex["instruction"]))
        else:
            prompt = _tf_format(T.CRITIC_PROMPT, instruction=ex["instruction"], input=ex["input"])
        return {"prompt": prompt, "target": ex["output"], "id": ex["id"], "line": ex["line"]}

    return fn


def _tokenize_fn(prompt_vocab: SelfRAGVocabulary, target_vocab: SelfRAGVocabulary):
    @seqio.map_over_dataset
    def fn(ex):
        return {"prompt_ids": prompt_vocab.encode_tf(ex["prompt"]), "target_ids": target_vocab.encode_tf(ex["target"]),
                "id": ex["id"], "line": ex["line"]}

    return fn


def _mask_fn(kind: str, ids: SpecialIds, mask: MaskConfig):
    """BOS + prompt + target + EOS, truncated to sequence_length["targets"], loss weights."""

    def fn(dataset, sequence_length=None):
        max_tokens = (sequence_length or {}).get("targets")

        def py(prompt, target):
            ex = assemble(prompt, target, kind, ids, mask, max_tokens)
            return ex.tokens, ex.weights, np.bool_(ex.truncated)

        def one(ex):
            tokens, weights, truncated = tf.numpy_function(py, [ex["prompt_ids"], ex["target_ids"]],
                                                           (tf.int32, tf.float32, tf.bool), stateful=False)
            return {"targets": tf.ensure_shape(tokens, [None]), "loss_weights": tf.ensure_shape(weights, [None]),
                    "truncated": tf.ensure_shape(truncated, []), "id": ex["id"], "line": ex["line"]}

        return dataset.map(one, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)

    return fn


def task_name(spec: TaskSpec) -> str:
    return f"selfrag_jax_{spec.name}"


def register_tasks(cfg: DataConfig, tokenizer, data_dir: str | None = None, mixture: str = "selfrag_jax_mixture") -> str:
    """Registers (replacing earlier ones of the same name) one seqio Task per TaskSpec and a
    Mixture of them with the specs' rates; returns the mixture's name."""
    text_vocab, structured_vocab = SelfRAGVocabulary(tokenizer), SelfRAGVocabulary(tokenizer, structured=True)
    ids = SpecialIds.of(tokenizer)
    builders: dict[tuple[str, str], SelfragJsonl] = {}
    for spec in cfg.tasks:
        key = (os.path.abspath(spec.path), spec.kind)
        if key not in builders:
            builders[key] = prepare_jsonl(spec.path, spec.kind, data_dir)
        builder = builders[key]
        critic_type = spec.critic_type

        def dataset_fn(split, shuffle_files, seed=None, builder=builder, critic_type=critic_type):
            ds = builder.as_dataset(split="train", shuffle_files=False)
            return ds.filter(lambda ex: tf.equal(ex["type"], critic_type)) if critic_type else ds

        if spec.kind == "generator":
            target_vocab = structured_vocab
        else:
            target_vocab = text_vocab if cfg.mask.critic_labels == "text" else structured_vocab
        name = task_name(spec)
        if name in seqio.TaskRegistry.names():
            seqio.TaskRegistry.remove(name)
        seqio.TaskRegistry.add(
            name,
            source=seqio.FunctionDataSource(dataset_fn, splits=("train",)),
            preprocessors=[_texts_fn(spec.kind), _tokenize_fn(text_vocab, target_vocab),
                           _mask_fn(spec.kind, ids, cfg.mask)],
            output_features={
                # One vocabulary for every task (a seqio Mixture requires it); the critic's plain-
                # text labels are encoded by _tokenize_fn. EOS is added by _mask_fn.
                "targets": seqio.Feature(vocabulary=structured_vocab, add_eos=False, dtype=tf.int32),
                "loss_weights": seqio.Feature(vocabulary=seqio.PassThroughVocabulary(len(tokenizer)), add_eos=False,
                                              dtype=tf.float32),
            },
        )
    if mixture in seqio.MixtureRegistry.names():
        seqio.MixtureRegistry.remove(mixture)
    seqio.MixtureRegistry.add(mixture, [(task_name(t), t.rate) for t in cfg.tasks])
    return mixture


class ListSource:
    """A task's examples, materialised from its seqio dataset in file order."""

    def __init__(self, examples: list[Example]):
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def example(self, i: int) -> Example:
        return self.examples[i]


def seqio_sources(cfg: DataConfig, tokenizer, data_dir: str | None = None) -> list[ListSource]:
    register_tasks(cfg, tokenizer, data_dir)
    length = {"targets": cfg.seq_len + 1, "loss_weights": cfg.seq_len + 1}
    sources = []
    for spec in cfg.tasks:
        task = seqio.get_mixture_or_task(task_name(spec))
        ds = task.get_dataset(sequence_length=length, split="train", shuffle=False, num_epochs=1, use_cached=False,
                              try_in_mem_cache=False)
        examples = [Example(ex["targets"].astype(np.int32), ex["loss_weights"].astype(np.float32), bool(ex["truncated"]))
                    for ex in tfds.as_numpy(ds)]
        if not examples:
            raise ValueError(f"{spec.path}: no records for task {spec.name}")
        sources.append(ListSource(examples))
    return sources
