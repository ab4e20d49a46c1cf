"""The Self-RAG tokenizer: a Hugging Face tokenizer plus the reflection tokens, by id.

Two kinds of text reach the model:
- trusted structure (prompts, the framework's own control tokens), and
- untrusted text (questions, passages, user data), encoded with special-token parsing off,
  so characters such as `[Fully supported]` or `</paragraph>` in a passage become ordinary
  pieces. Control tokens are inserted only by id (`control_id`), never parsed from text.
A final check on every untrusted encoding guarantees that no control id slips through.
"""

from __future__ import annotations

import os
import re
from functools import cached_property
from pathlib import Path
from typing import Iterable, Sequence

from selfrag_jax import tokens as T


class SelfRAGTokenizer:
    def __init__(self, hf_tokenizer, add_control_tokens: bool = True):
        self.hf = hf_tokenizer
        missing = [t for t in T.CONTROL_TOKENS if t not in self.hf.get_vocab()]
        if missing and not add_control_tokens:
            raise ValueError(f"tokenizer lacks control token {missing[0]!r}")
        if missing:
            present = [t for t in T.CONTROL_TOKENS if t not in missing]
            if present:
                raise ValueError(f"tokenizer has some control tokens ({present[0]!r}) but not {missing[0]!r}; "
                                 "refusing to guess their ids")
            self.base_vocab_size = len(self.hf)
            # Reference order, so a Llama-2 base gets ids 32000..32014 and <pad> 32015.
            self.hf.add_special_tokens({"additional_special_tokens": list(T.REFLECTION_TOKENS)})
            self.hf.add_special_tokens({"pad_token": T.PAD_TOKEN})
            ids = [self.hf.convert_tokens_to_ids(t) for t in T.CONTROL_TOKENS]
            if ids != list(range(self.base_vocab_size, self.base_vocab_size + len(T.CONTROL_TOKENS))):
                raise ValueError(f"control tokens got ids {ids}, expected {self.base_vocab_size}.. in reference order")
        else:
            self.base_vocab_size = min(self.hf.convert_tokens_to_ids(t) for t in T.CONTROL_TOKENS)
        if self.hf.pad_token is None:
            self.hf.pad_token = T.PAD_TOKEN
        self._control = {t: self.hf.convert_tokens_to_ids(t) for t in T.CONTROL_TOKENS}
        self._split_re = re.compile("(" + "|".join(re.escape(t) for t in T.REFLECTION_TOKENS) + ")")

    # --- construction -------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, add_control_tokens: bool = True) -> "SelfRAGTokenizer":
        from transformers import AutoTokenizer

        path = Path(path)
        if not (path / "tokenizer.json").exists() and not (path / "tokenizer.model").exists():
            raise FileNotFoundError(f"{path}: no tokenizer.json or tokenizer.model")
        return cls(AutoTokenizer.from_pretrained(str(path)), add_control_tokens=add_control_tokens)

    def save(self, path: str | os.PathLike) -> None:
        self.hf.save_pretrained(str(path))

    # --- ids ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.hf)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def control_id(self, token: str) -> int:
        return self._control[token]

    def group_ids(self, group: Sequence[str]) -> tuple[int, ...]:
        return tuple(self._control[t] for t in group)

    @cached_property
    def retrieve_ids(self) -> tuple[int, ...]:
        return self.group_ids(T.RETRIEVE_GROUP)

    @cached_property
    def isrel_ids(self) -> tuple[int, ...]:
        return self.group_ids(T.ISREL_GROUP)

    @cached_property
    def issup_ids(self) -> tuple[int, ...]:
        return self.group_ids(T.ISSUP_GROUP)

    @cached_property
    def isuse_ids(self) -> tuple[int, ...]:
        return self.group_ids(T.ISUSE_GROUP)

    @cached_property
    def control_ids(self) -> frozenset[int]:
        return frozenset(self._control.values())

    @cached_property
    def forbidden_in_text(self) -> frozenset[int]:
        """Ids that untrusted text must never produce: control tokens, BOS, EOS, pad."""
        extra = {i for i in (self.hf.bos_token_id, self.hf.eos_token_id, self.hf.pad_token_id) if i is not None}
        return self.control_ids | extra

    @property
    def bos_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def eos_id(self) -> int:
        return self.hf.eos_token_id

    @property
    def pad_id(self) -> int:
        return self._control[T.PAD_TOKEN]

    # --- encoding -----------------------------------------------------------------------
    def encode_text(self, text: str) -> list[int]:
        """Untrusted text -> ids. Special-token syntax in the text is never honoured."""
        ids = self.hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] if text else []
        bad = [i for i in ids if i in self.forbidden_in_text]
        if bad:  # a tokenizer whose model vocabulary itself maps text to a control id
            raise ValueError(f"text encodes to control id {bad[0]} ({self.hf.convert_ids_to_tokens(bad[0])!r})")
        return ids

    def encode_prompt(self, instruction: str, input: str = "", bos: bool = True) -> list[int]:
        """The generator prompt of the paper; instruction and input are untrusted text."""
        prefix = [self.bos_id] if bos and self.bos_id is not None else []
        return prefix + self.encode_text(T.format_prompt(instruction, input))

    def encode_passage(self, title: str, text: str, retrieval_token: bool = True) -> list[int]:
        """`[Retrieval]<paragraph>{title}\\n{text}</paragraph>`, markers by id."""
        head = [self._control[T.RETRIEVAL]] if retrieval_token else []
        return (head + [self._control[T.PARAGRAPH_OPEN]] + self.encode_text(T.passage_text(title, text))
                + [self._control[T.PARAGRAPH_CLOSE]])

    def encode_structured(self, text: str) -> list[int]:
        """Trusted Self-RAG training text (e.g. an `output` field): reflection-token strings
        become their ids, everything between them is encoded as untrusted text."""
        ids: list[int] = []
        for part in self._split_re.split(text):
            if not part:
                continue
            ids.extend([self._control[part]] if part in self._control else self.encode_text(part))
        return ids

    def decode(self, ids: Iterable[int], skip_control: bool = True) -> str:
        ids = [int(i) for i in ids]
        if skip_control:
            ids = [i for i in ids if i not in self.forbidden_in_text]
        return self.hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def id_to_token(self, i: int) -> str:
        return self.hf.convert_ids_to_tokens(int(i))


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike | None = None):
    """Train a byte-level BPE tokenizer (Llama-style `<unk> <s> </s>` at ids 0-2; digits split
    one by one) and return it as a transformers tokenizer; saved to `out_dir` when given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    if out_dir is not None:
        hf.save_pretrained(str(out_dir))
    return hf
