"""GGUF files (llama.cpp) of Llama-architecture models: config, weights and tokenizer.

A GGUF file holds its config as metadata (`llama.block_count`, ...), its tokenizer as
metadata too (`tokenizer.ggml.tokens`, `.merges`, ...), and its tensors under llama.cpp's
names, often quantized. `GGUFModel` presents it as a Hugging Face Llama folder would be:
a `config.json` dictionary, tensors under HF names in HF's `[out, in]` layout (dequantized
to float32 by the `gguf` package, the optional `gguf` extra; no torch), and a tokenizer. So
`models.hf` loads it through the same name table as safetensors.

llama.cpp's converter permutes the rows of q and k from HF's rotate-half RoPE layout to its
interleaved one (`permute` in convert_hf_to_gguf.py); `tensor` undoes that.
"""

from __future__ import annotations

import os
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

# llama.cpp tensor names -> HF names ("{i}" is the layer index).
TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
# llama.cpp pre-tokenizer names -> how text is split before byte-level BPE.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = ("default", "gpt2", "smollm", "llama-bpe", "llama3")
# GGUF token types that are special tokens (llama.cpp: 3 control, 4 user-defined).
SPECIAL_TOKEN_TYPES = (3, 4)


def is_gguf(path: str | os.PathLike) -> bool:
    p = Path(path)
    return p.is_file() and p.suffix == ".gguf"


class GGUFModel:
    """One GGUF file, read lazily: metadata at once, each tensor when asked for."""

    def __init__(self, path: str | os.PathLike):
        try:
            import gguf
        except ImportError:
            raise ImportError("reading GGUF files needs the gguf package: pip install 'selfrag-jax[gguf]'") from None
        self.path = Path(path)
        self._gguf = gguf
        self.reader = gguf.GGUFReader(str(self.path))
        arch = self.field("general.architecture")
        if arch != "llama":
            raise ValueError(f"{self.path}: general.architecture={arch!r} is not supported (only llama)")
        self._tensors = {t.name: t for t in self.reader.tensors}
        if "rope_freqs.weight" in self._tensors:
            raise ValueError(f"{self.path}: tensor rope_freqs.weight (per-frequency RoPE factors, Llama 3.1) is not "
                             "supported")
        self.weight_map = {}
        for name in self._tensors:
            hf = _hf_name(name)
            if hf is None:
                raise ValueError(f"{self.path}: tensor {name!r} is not part of a Llama model")
            self.weight_map[hf] = name
        self._last: tuple[str, np.ndarray] | None = None  # a placed load asks once per device

    # --- metadata -------------------------------------------------------------------------
    def field(self, key: str, default: Any = None) -> Any:
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    @cached_property
    def hf_config(self) -> dict[str, Any]:
        """The model's `config.json`, as a Hugging Face export of it would read."""
        llama = lambda key, default=None: self.field(f"llama.{key}", default)  # noqa: E731
        heads = int(llama("attention.head_count"))
        hidden = int(llama("embedding_length"))
        config = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": len(self.field("tokenizer.ggml.tokens")),
            "hidden_size": hidden, "intermediate_size": int(llama("feed_forward_length")),
            "num_hidden_layers": int(llama("block_count")), "num_attention_heads": heads,
            "num_key_value_heads": int(llama("attention.head_count_kv", heads)),
            "head_dim": int(llama("attention.key_length", hidden // heads)),
            "max_position_embeddings": int(llama("context_length")),
            "rms_norm_eps": float(llama("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(llama("rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id"),
        }
        scaling = llama("rope.scaling.type", "none")
        if scaling == "linear":
            config["rope_scaling"] = {"rope_type": "linear", "factor": float(llama("rope.scaling.factor"))}
        elif scaling != "none":
            raise ValueError(f"{self.path}: llama.rope.scaling.type={scaling!r} is not supported (none or linear)")
        return config

    # --- tensors (the SafetensorsReader interface) -----------------------------------------
    def names(self) -> list[str]:
        return list(self.weight_map)

    def shape_dtype(self, name: str) -> tuple[tuple[int, ...], str]:
        # GGUF lists dimensions innermost first; HF's [out, in] is the reverse.
        return tuple(int(n) for n in reversed(self._tensors[self.weight_map[name]].shape)), "float32"

    def get(self, name: str) -> np.ndarray:
        """The tensor under its HF name, dequantized to float32, in HF's layout."""
        if self._last is None or self._last[0] != name:
            self._last = (name, self._dequantize(name))
        return self._last[1]

    def _dequantize(self, name: str) -> np.ndarray:
        t = self._tensors[self.weight_map[name]]
        try:
            value = self._gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ValueError(f"{self.path}: tensor {t.name!r} has quantization type {t.tensor_type.name}, which the "
                             "gguf package cannot dequantize") from None
        value = np.asarray(value, np.float32).reshape(self.shape_dtype(name)[0])
        if name.endswith("q_proj.weight"):
            value = unpermute(value, self.hf_config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            value = unpermute(value, self.hf_config["num_key_value_heads"])
        return value

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        return self.get(name)[index]

    # --- tokenizer --------------------------------------------------------------------------
    def tokenizer(self):
        """A transformers fast tokenizer rebuilt from the file's vocabulary: byte-level BPE
        (`gpt2`: Llama 3, SmolLM2) or SentencePiece BPE (`llama`: Llama 2, the released Self-RAG)."""
        from tokenizers import AddedToken
        from transformers import PreTrainedTokenizerFast

        kind = self.field("tokenizer.ggml.model")
        tokens = list(self.field("tokenizer.ggml.tokens"))
        if kind == "gpt2":
            tok = self._byte_level_bpe(tokens)
        elif kind == "llama":
            tok = self._sentencepiece_bpe(tokens)
        else:
            raise ValueError(f"{self.path}: tokenizer.ggml.model={kind!r} is not supported (gpt2 or llama)")
        types = self.field("tokenizer.ggml.token_type") or []
        tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, token_type in enumerate(types) if token_type in SPECIAL_TOKEN_TYPES])
        named = {key: tokens[i] for key in ("bos", "eos", "unknown")
                 if (i := self.field(f"tokenizer.ggml.{key}_token_id")) is not None}
        hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=named.get("bos"), eos_token=named.get("eos"),
                                     unk_token=named.get("unknown"))
        template = self.field("tokenizer.chat_template")
        if template:  # kept, never applied unless asked
            hf.chat_template = template
        return hf

    def _byte_level_bpe(self, tokens: list[str]):
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

        pre = self.field("tokenizer.ggml.pre", "default")
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre in ("default", "gpt2", "smollm"))
        if pre in ("default", "gpt2"):
            splitter = byte_level
        elif pre == "smollm":  # digits one by one, then GPT-2's split
            splitter = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        elif pre in ("llama-bpe", "llama3"):
            splitter = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"), byte_level])
        else:
            raise ValueError(f"{self.path}: tokenizer.ggml.pre={pre!r} is not supported (one of {PRE_TOKENIZERS})")
        merges = [tuple(m.split(" ", 1)) for m in self.field("tokenizer.ggml.merges")]
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
        tok.pre_tokenizer = splitter
        tok.decoder = decoders.ByteLevel()
        return tok

    def _sentencepiece_bpe(self, tokens: list[str]):
        """SentencePiece's BPE as Hugging Face's Llama-2 fast tokenizer runs it: a piece merges
        from its two halves, the higher-scoring piece first; spaces become "▁" with one
        prepended; characters outside the vocabulary fall back to their UTF-8 bytes."""
        from tokenizers import Tokenizer, decoders, models, normalizers

        scores = self.field("tokenizer.ggml.scores")
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = []
        for piece, score in zip(tokens, scores):
            merges += [(piece[:k], piece[k:], score, vocab[piece[:k]], vocab[piece[k:]]) for k in range(1, len(piece))
                       if piece[:k] in vocab and piece[k:] in vocab]
        merges.sort(key=lambda m: (-m[2], m[3], m[4]))
        unk = self.field("tokenizer.ggml.unknown_token_id")
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for a, b, *_ in merges], fuse_unk=True,
                                   byte_fallback=True, unk_token=tokens[unk] if unk is not None else None))
        prefix = [normalizers.Prepend("▁")] if self.field("tokenizer.ggml.add_space_prefix", True) else []
        tok.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "▁")])
        strip = [decoders.Strip(" ", 1, 0)] if prefix else []
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
        return tok


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's q/k row permutation: per head, rows (pair, half) -> (half, pair)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str | None:
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.weight"
    return None
