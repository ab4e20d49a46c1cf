"""The Flax BERT encoder against transformers' PyTorch BertModel, and how folders are read."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from selfrag_jax.models.torch_zip import load_torch_zip
from selfrag_jax.retrieval.encoder import (
    EncoderConfig,
    TextEncoder,
    load_hf_state,
    read_encoder_spec,
)
from test_retrieval_support import make_tiny_bert, minilm_path, tiny_bert_state

SNIPPETS = [
    "Where was Marie Curie born?", "the", "a", "?", "Ünïcödé façade naïve café", "東京タワーの高さは？",
    "Москва — столица России.", "emoji 🚀🔥 test 👍🏽", "ÅÄÖ åäö ß ẞ", "   leading and trailing spaces   ",
    "tabs\tand\nnewlines", "1234567890 3.14159 -42 1e10", "C++ / Python: def f(x): return x**2",
    "https://example.org/path?q=1&r=2", "<html><body>tag soup</body></html>", "مرحبا بالعالم",
    "Γειά σου Κόσμε", "नमस्ते दुनिया", "UPPER CASE SHOUTING", "mIxEd CaSe WoRdS",
]  # fmt: skip


def varied_texts(n: int = 200, seed: int = 0) -> list[str]:
    """Short, empty-ish, unicode, and far longer than the 256-token limit."""
    rng = random.Random(seed)
    texts = ["", " ", "\n", "."] + SNIPPETS
    while len(texts) < n:
        kind = rng.random()
        if kind < 0.15:  # longer than max length (truncated)
            texts.append(" ".join(rng.choices(SNIPPETS, k=rng.randint(60, 120))))
        elif kind < 0.3:
            texts.append(rng.choice(SNIPPETS)[: rng.randint(1, 4)])
        else:
            texts.append(" ".join(rng.choices(SNIPPETS, k=rng.randint(1, 12))))
    return texts[:n]


@pytest.mark.slow
def test_minilm_matches_pytorch_bertmodel(capsys):
    torch = pytest.importorskip("torch")
    from transformers import AutoTokenizer, BertModel

    torch.set_num_threads(2)
    texts = varied_texts()
    encoder = TextEncoder.load(config=EncoderConfig(batch_size=64))
    assert (encoder.spec.pooling, encoder.spec.normalize, encoder.spec.max_length) == ("mean", True, 256)
    ours = encoder.encode(texts)

    tokenizer = AutoTokenizer.from_pretrained(str(minilm_path()))
    model = BertModel.from_pretrained(str(minilm_path())).eval()
    theirs = []
    for start in range(0, len(texts), 50):
        batch = tokenizer(texts[start : start + 50], padding=True, truncation=True, max_length=256, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"][..., None].float()
        pooled = (hidden * mask).sum(1) / mask.sum(1)
        theirs.append(torch.nn.functional.normalize(pooled, dim=-1).numpy())
        ids = [row[row_mask.bool()].tolist() for row, row_mask in zip(batch["input_ids"], batch["attention_mask"])]
        assert ids == encoder.tokenize(texts[start : start + 50])  # the 128-token cap was reset
    theirs = np.concatenate(theirs)
    cosine = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    assert max(len(t) for t in encoder.tokenize(texts)) == 256
    with capsys.disabled():
        print(f"\nMiniLM parity on {len(texts)} texts: min cosine {cosine.min():.7f}, mean {cosine.mean():.7f}")
    assert cosine.min() >= 0.9999, f"worst text {texts[int(cosine.argmin())]!r}: cosine {cosine.min()}"
    # small batches run on one device, large ones split over all (8 here): same vectors
    np.testing.assert_allclose(encoder.encode(texts[:3]), ours[:3], rtol=1e-5, atol=1e-6)
    # few compiled programs: length buckets x power-of-two batch sizes
    assert len(encoder.compiled_shapes) <= 10, encoder.compiled_shapes


def test_bare_bert_folder_means_mean_pooling_without_normalisation(tmp_path):
    folder = make_tiny_bert(tmp_path / "contriever-like")
    spec = read_encoder_spec(folder)
    assert (spec.pooling, spec.normalize, spec.max_length, spec.dimension) == ("mean", False, 512, 32)
    overridden = read_encoder_spec(folder, pooling="cls", normalize=True, max_length=64)
    assert (overridden.pooling, overridden.normalize, overridden.max_length) == ("cls", True, 64)


def test_sentence_transformers_pooling_config_is_read(tmp_path):
    folder = make_tiny_bert(tmp_path / "st")
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]))  # fmt: skip
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128}))
    spec = read_encoder_spec(folder)
    assert (spec.pooling, spec.normalize, spec.max_length) == ("cls", False, 128)
    (folder / "1_Pooling" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"1_Pooling/config.json:1: invalid JSON"):
        read_encoder_spec(folder)


def test_torch_checkpoint_reads_without_torch(tmp_path):
    torch = pytest.importorskip("torch")
    state = tiny_bert_state(seed=3)
    torch.save({k: torch.from_numpy(v) for k, v in state.items()}, tmp_path / "pytorch_model.bin")
    loaded = load_torch_zip(tmp_path / "pytorch_model.bin")
    assert loaded.keys() == state.keys()
    for key in state:
        np.testing.assert_array_equal(loaded[key], state[key])
    # a transposed (non-contiguous) tensor keeps its values
    torch.save({"t": torch.arange(6, dtype=torch.float32).reshape(2, 3).t()}, tmp_path / "t.bin")
    np.testing.assert_array_equal(load_torch_zip(tmp_path / "t.bin")["t"], np.arange(6, dtype=np.float32).reshape(2, 3).T)


def test_bin_and_safetensors_folders_embed_identically(tmp_path):
    torch = pytest.importorskip("torch")
    safe = make_tiny_bert(tmp_path / "safe", seed=1)
    binary = make_tiny_bert(tmp_path / "bin", seed=1)
    state = load_hf_state(binary)
    (binary / "model.safetensors").unlink()
    torch.save({f"bert.{k}": torch.from_numpy(v) for k, v in state.items()}, binary / "pytorch_model.bin")
    texts = ["one passage", "another, longer passage about chemistry and music"]
    a = TextEncoder.load(safe).encode(texts)
    b = TextEncoder.load(binary).encode(texts)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert np.linalg.norm(a, axis=1).std() > 1e-3  # unnormalised, as the folder says


def test_missing_weights_name_the_folder(tmp_path):
    folder = make_tiny_bert(tmp_path / "broken")
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="broken: no model.safetensors"):
        TextEncoder.load(folder)
