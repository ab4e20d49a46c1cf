"""A small byte-level BPE tokenizer for the world, saved as a Hugging Face tokenizer folder.

The model must copy a value from the passage into the answer token for token
(docs/tiny-models.md), so a value must be the same pieces wherever it stands. GPT-2 style
pre-tokenisation glues a space to the *next* word, so "born in Orvane" and "[Relevant]Orvane"
would differ. Here a capitalised word never carries a space (names and places tokenise the
same in titles, questions, passages and answers), a lower-case word or a punctuation run
carries its *trailing* space (the world's templates always put punctuation after a
lower-case value, so "baker." and "[Relevant]baker" agree), and every digit stands alone.
Trailing spaces keep sequences about a third shorter than isolating every space. Like
Llama, encoding adds `<s>` and no `</s>`. The reflection tokens are not added here: the
project's tokenizer wrapper appends them by id.
"""

from __future__ import annotations

import json
import os
from typing import Iterable

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2 as in Llama
# Capitalised words alone; lower-case words and symbol runs with one trailing space; single
# digits; any other whitespace character alone.
PRETOKENIZE_PATTERN = r"\p{Lu}\p{Ll}*|\p{Ll}+ ?|\p{N}|[^\s\p{L}\p{N}]+ ?|\s"


def train_tokenizer(texts: Iterable[str], out_dir: str, vocab_size: int = 3000, model_max_length: int = 2048) -> str:
    """Trains on `texts` and writes tokenizer.json, tokenizer_config.json and
    special_tokens_map.json to `out_dir` (loadable by AutoTokenizer.from_pretrained)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])

    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials, "add_bos_token": True,
              "add_eos_token": False, "clean_up_tokenization_spaces": False, "model_max_length": model_max_length}
    for name, obj in (("tokenizer_config.json", config), ("special_tokens_map.json", specials)):
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
    return out_dir
