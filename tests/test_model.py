"""The Flax Llama against transformers' PyTorch LlamaForCausalLM, and lossless conversion."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch
from helpers import TINY_HF, make_hf_llama, ragged_batch

from selfrag_jax.models.hf import SafetensorsReader, export_hf, load_hf
from selfrag_jax.models.llama import Llama

torch.set_num_threads(2)

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
CASES = {
    "mha": dict(num_key_value_heads=4),
    "gqa": dict(num_key_value_heads=2),
    "tied": dict(tie_word_embeddings=True),
    "untied_mqa": dict(num_key_value_heads=1, tie_word_embeddings=False),
    "llama3_rope": dict(rope_scaling=LLAMA3_ROPE, rope_theta=500000.0),
    "selfrag_vocab": dict(vocab_size=32016, pad_token_id=32015),
}


def torch_logits(folder, tokens, mask):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask)).logits.numpy()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("scan", [True, False], ids=["scan", "noscan"])
def test_logits_match_transformers(tmp_path, case, scan):
    folder = make_hf_llama(tmp_path / "hf", **CASES[case])
    config, params, _ = load_hf(folder, scan_layers=scan)
    tokens, mask, lengths = ragged_batch(config.vocab_size)
    ref = torch_logits(folder, tokens, mask)
    ours, _ = Llama(config).apply({"params": params}, tokens, segment_ids=mask)
    ours = np.asarray(ours)
    for row, n in enumerate(lengths):  # padded positions are not defined by either model
        np.testing.assert_allclose(ours[row, :n], ref[row, :n], atol=1e-4, rtol=0)


def test_packed_segments_do_not_attend_across(tmp_path):
    """Two sequences packed in one row give the logits they give alone."""
    folder = make_hf_llama(tmp_path / "hf")
    config, params, _ = load_hf(folder)
    model = Llama(config)
    a, b = np.arange(3, 14), np.arange(20, 27)
    packed = np.concatenate([a, b])[None]
    seg = np.array([[1] * len(a) + [2] * len(b)])
    pos = np.array([list(range(len(a))) + list(range(len(b)))])
    out, _ = model.apply({"params": params}, packed, positions=pos, segment_ids=seg)
    alone_a, _ = model.apply({"params": params}, a[None])
    alone_b, _ = model.apply({"params": params}, b[None])
    np.testing.assert_allclose(out[0, : len(a)], alone_a[0], atol=1e-5)
    np.testing.assert_allclose(out[0, len(a):], alone_b[0], atol=1e-5)


@pytest.mark.parametrize("dtype,shard_gb", [("float32", 5.0), ("bfloat16", 1e-5)], ids=["f32_single", "bf16_sharded"])
def test_round_trip_hf_ckpt_hf_is_bit_identical(tmp_path, dtype, shard_gb):
    from selfrag_jax.models.convert import ckpt_to_hf, hf_to_ckpt

    src = make_hf_llama(tmp_path / "hf", dtype=dtype, tokenizer=True, vocab_size=300)
    hf_to_ckpt(str(src), str(tmp_path / "ckpt"))
    ckpt_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "back"), max_shard_bytes=int(shard_gb * 2**30))
    if shard_gb < 1:
        assert (tmp_path / "back" / "model.safetensors.index.json").exists()
    a, b = SafetensorsReader(src), SafetensorsReader(tmp_path / "back")
    assert sorted(a.names()) == sorted(b.names())
    for name in a.names():
        x, y = a.get(name), b.get(name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert x.tobytes() == y.tobytes(), name
    assert json.loads((src / "config.json").read_text()) == json.loads((tmp_path / "back" / "config.json").read_text())
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


def test_export_of_our_params_loads_in_transformers(tmp_path):
    """A model that never came from HF (random init of ours) exports to a folder that
    transformers reads and computes the same logits with."""
    from selfrag_jax.models.config import preset
    from selfrag_jax.models.llama import init_params

    config = preset("tiny", vocab_size=96, tie_word_embeddings=True)
    params = init_params(config, 3)
    export_hf(params, config, tmp_path / "hf")
    tokens, mask, lengths = ragged_batch(96)
    ref = torch_logits(tmp_path / "hf", tokens, mask)
    ours, _ = Llama(config).apply({"params": params}, tokens, segment_ids=mask)
    for row, n in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(ours)[row, :n], ref[row, :n], atol=1e-4)


def test_greedy_kv_cache_matches_full_forward_and_transformers_generate(tmp_path):
    import jax
    import jax.numpy as jnp
    from transformers import LlamaForCausalLM

    from selfrag_jax.inference.decode import greedy_generate, pad_batch

    folder = make_hf_llama(tmp_path / "hf", seed=1)
    config, params, _ = load_hf(folder)
    prompts = [[5, 9, 33, 71, 2 + 10, 44, 90], [17, 3, 8], [100, 101, 102, 103, 104]]
    tokens, lengths = pad_batch(prompts, pad_id=0)
    steps = 32
    out, counts = greedy_generate(params, config, tokens, lengths, steps, stop_ids=jnp.array([-1]))
    out = np.asarray(out)
    assert (np.asarray(counts) == steps).all()

    # Full forward passes without a cache, on one fixed width (causal: the right padding
    # cannot change earlier positions), so this compiles once.
    width = max(map(len, prompts)) + steps
    forward = jax.jit(lambda p, t: Llama(config).apply({"params": p}, t)[0])
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for row, prompt in enumerate(prompts):
        seq = list(prompt)
        for _ in range(steps):
            logits = forward(params, np.array([seq + [0] * (width - len(seq))]))
            seq.append(int(np.argmax(logits[0, len(seq) - 1])))
        assert seq[len(prompt):] == out[row].tolist()
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        assert ref[0, len(prompt):].tolist() == out[row].tolist()


def test_greedy_stops_rows_independently(tmp_path):
    import jax.numpy as jnp

    from selfrag_jax.inference.decode import greedy_generate, pad_batch

    folder = make_hf_llama(tmp_path / "hf", seed=2)
    config, params, _ = load_hf(folder)
    prompts = [[5, 9, 33], [17, 3, 8, 60, 61]]
    tokens, lengths = pad_batch(prompts, pad_id=0)
    full, _ = greedy_generate(params, config, tokens, lengths, 12, stop_ids=jnp.array([-1]))
    stop = int(np.asarray(full)[0, 4])  # the 5th token of row 0 becomes its stop token
    out, counts = greedy_generate(params, config, tokens, lengths, 12, stop_ids=jnp.array([stop]), pad_id=-7)
    out, counts, full = np.asarray(out), np.asarray(counts), np.asarray(full)
    first = list(full[0]).index(stop)
    assert counts[0] == first + 1 and (out[0, : first + 1] == full[0, : first + 1]).all() and (out[0, first + 1:] == -7).all()
    alone, _ = greedy_generate(params, config, tokens[1:], lengths[1:], 12, stop_ids=jnp.array([stop]), pad_id=-7)
    assert (np.asarray(alone)[0] == out[1]).all()


def test_missing_tensor_fails_with_its_name(tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = make_hf_llama(tmp_path / "hf")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        load_hf(folder)


def test_config_keys_that_change_nothing_are_noted_and_those_that_do_refused(tmp_path, caplog):
    folder = make_hf_llama(tmp_path / "hf")
    cfg = json.loads((folder / "config.json").read_text())
    # what a real file (SmolLM2 dequantized by transformers) carries beside the shape
    (folder / "config.json").write_text(json.dumps({**cfg, "_model_name_or_path": "x/y", "unk_token_id": 0,
                                                    "sliding_window": None}))
    with caplog.at_level("WARNING"):
        config, _, _ = load_hf(folder)
    assert config.num_layers == cfg["num_hidden_layers"]
    assert "ignoring keys a Llama does not compute with: _model_name_or_path, unk_token_id" in caplog.text
    (folder / "config.json").write_text(json.dumps({**cfg, "sliding_window": 4096}))
    with pytest.raises(ValueError, match=r"config\.json: sliding_window=4096 is not supported"):
        load_hf(folder)


def test_unsupported_feature_and_wrong_shape_fail(tmp_path):
    folder = make_hf_llama(tmp_path / "hf")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "attention_bias": True}))
    with pytest.raises(ValueError, match="attention_bias=True is not supported"):
        load_hf(folder)
    (folder / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 48}))
    with pytest.raises(ValueError, match=r"gate_proj\.weight.*shape"):
        load_hf(folder)


def test_cli_convert_errors_are_one_line(tmp_path, capsys):
    from selfrag_jax.cli import main

    assert main(["convert", "hf-to-ckpt", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "config.json" in err[0]
    assert not (tmp_path / "out").exists()


def test_preset_override_derives_head_dim_again():
    """base.yaml's 128-wide, 4-head override of the 64-wide tiny preset once kept tiny's heads of 16."""
    from selfrag_jax.models.config import preset

    assert preset("tiny", hidden_size=128).head_dim == 32
    assert preset("tiny", num_heads=8, num_kv_heads=2).head_dim == 8
    assert preset("tiny", hidden_size=128, head_dim=16).head_dim == 16  # set: kept
    explicit = preset("tiny", head_dim=48)  # not derived: a new width keeps it
    assert explicit.replace(hidden_size=128).head_dim == 48
    assert preset("tiny", vocab_size=100).head_dim == 16  # the shape unchanged


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pytorch_bin_shards_load_without_torch_and_export_bit_for_bit(tmp_path, dtype):
    """A 2023-style folder (`pytorch_model-*.bin` shards + index) loads like its safetensors
    twin, and exports the same tensors bit for bit."""
    import shutil

    from safetensors.numpy import load_file
    from transformers import LlamaForCausalLM

    st = make_hf_llama(tmp_path / "st", dtype=dtype)
    state = LlamaForCausalLM.from_pretrained(st, dtype=getattr(torch, dtype)).state_dict()
    binf = tmp_path / "bin"
    binf.mkdir()
    shutil.copy(st / "config.json", binf / "config.json")
    names, weight_map = sorted(state), {}
    for n, part in enumerate((names[:7], names[7:14], names[14:]), 1):  # as transformers 4 sharded them
        file = f"pytorch_model-{n:05d}-of-00003.bin"
        torch.save({k: state[k].clone() for k in part}, binf / file)
        weight_map.update({k: file for k in part})
    (binf / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config_st, params_st, _ = load_hf(st)
    config_bin, params_bin, meta = load_hf(binf)
    assert config_bin == config_st
    for a, b in zip(jax.tree.leaves(params_st), jax.tree.leaves(params_bin)):
        assert np.array_equal(a, b)
    export_hf(params_bin, config_bin, tmp_path / "out", meta=meta)
    want, got = load_file(st / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and np.array_equal(got[name], want[name]), name
