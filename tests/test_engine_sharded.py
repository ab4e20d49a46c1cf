"""The engine sharded over a mesh against the same engine on one device, and bfloat16
against float32.

The model has GQA (16 query heads over 8 KV heads) and a vocabulary of 320, so every mesh
of 8 devices splits it, tensor-parallel included. Sharding changes the order of float32
sums (tensor-parallel partial sums are all-reduced), so scores agree to 1e-5, while every
decision (tokens, retrieve, chosen passage, kept rows) must be identical.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from test_inference import FakeRetriever, make_items, make_selfrag_model

from selfrag_jax import sharding
from selfrag_jax.inference.engine import ControlIds, Engine, Placement, Shapes
from selfrag_jax.inference.items import parse_item
from selfrag_jax.inference.longform import LongForm
from selfrag_jax.inference.scoring import RetrieveOptions
from selfrag_jax.inference.selfrag import GenerateOptions, ShortForm, output_record
from selfrag_jax.models.checkpoint import load_model

MAX_NEW = 12
SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=16, num_key_value_heads=8, head_dim=8)
MESHES = ("8,1,1", "2,1,4", "1,1,8", "2,2,2")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_selfrag_model(tmp_path_factory.mktemp("sharded") / "hf", base_vocab=304, **SHAPE)


def engine_for(folder, mesh: str | None = None, dtype: str | None = None) -> tuple[Engine, object]:
    placement = Placement(sharding.make_mesh(mesh)) if mesh else None
    config, params, tok, _ = load_model(folder, shardings=placement.params if placement else None, dtype=dtype)
    return Engine(params, config, ControlIds.from_tokenizer(tok), MAX_NEW, placement), tok


def runs(engine: Engine, tok) -> dict[str, list[dict]]:
    """Short form (adaptive, always, keep-top) and long form, as output records."""
    out = {}
    # p(retrieve) of these questions spans 0.542-0.562: 0.56 splits them.
    for name, kw in (("adaptive", dict(retrieve=RetrieveOptions(mode="adaptive", threshold=0.56))),
                     ("always", dict(retrieve=RetrieveOptions(mode="always"))),
                     ("keep_top", dict(retrieve=RetrieveOptions(mode="always"), keep_top=2))):
        sf = ShortForm(engine, tok, GenerateOptions(trace=True, **kw))
        out[name] = [output_record(r, sf.opts) for r in sf.run(make_items(5, seed=3))]
    online = [parse_item(json.dumps({"question": f"who is alice {i}?"}), f"t:{i}") for i in range(2)]
    lf = LongForm(engine, tok, GenerateOptions(task="asqa", ndocs=3, trace=True, beam_width=2, max_depth=2,
                                               retrieve=RetrieveOptions(mode="always")), FakeRetriever())
    out["long_form"] = [lf.record(r) for r in lf.run(online + make_items(2, seed=5, k=3))]
    return out


def split(value, floats: list):
    """The record with its floats taken out (into `floats`): what must be identical."""
    if isinstance(value, float):
        floats.append(value)
        return "<float>"
    if isinstance(value, dict):
        return {k: split(v, floats) for k, v in value.items()}
    if isinstance(value, list):
        return [split(v, floats) for v in value]
    return value


@pytest.fixture(scope="module")
def reference(folder):
    return runs(*engine_for(folder))


def test_reference_exercises_every_decision(reference):
    assert {r["retrieved"] for r in reference["adaptive"]} == {True, False}
    assert any(c.get("pruned") for r in reference["keep_top"] for c in r["candidates"])
    assert max(len(r["segments"]) for r in reference["long_form"]) > 1


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
def test_sharded_engine_equals_one_device(folder, reference, mesh):
    engine, tok = engine_for(folder, mesh)
    got = runs(engine, tok)
    for name, records in reference.items():
        want_floats, got_floats = [], []
        assert split(got[name], got_floats) == split(records, want_floats), f"{name} on mesh {mesh}"
        np.testing.assert_allclose(got_floats, want_floats, rtol=0, atol=1e-5, err_msg=f"{name} on mesh {mesh}")


def test_parameters_and_cache_carry_the_rules_shardings(folder):
    """Golden: the specs the rules table names (data x fsdp rows, tensor heads, fsdp embed), on
    the per-layer parameters and cache buffers decoding runs."""
    engine, _ = engine_for(folder, "2,2,2")
    layers = engine.params["layers_1"]
    want = {
        "embedding": P("tensor", "fsdp"), "lm_head": P("fsdp", "tensor"), "final_norm/scale": P(None),
        "layers/attn/wq": P("fsdp", "tensor", None), "layers/attn/wk": P("fsdp", "tensor", None),
        "layers/attn/wo": P("tensor", None, "fsdp"), "layers/mlp/gate": P("fsdp", "tensor"),
        "layers/mlp/down": P("tensor", "fsdp"), "layers/attn_norm/scale": P(None),
    }
    got = {"embedding": engine.params["embedding"], "lm_head": engine.params["lm_head"],
           "final_norm/scale": engine.params["final_norm"]["scale"], "layers/attn/wq": layers["attn"]["wq"],
           "layers/attn/wk": layers["attn"]["wk"], "layers/attn/wo": layers["attn"]["wo"],
           "layers/mlp/gate": layers["mlp"]["gate"], "layers/mlp/down": layers["mlp"]["down"],
           "layers/attn_norm/scale": layers["attn_norm"]["scale"]}
    for name, array in got.items():
        assert array.sharding.spec == want[name], name
        assert array.sharding.mesh.shape == {"data": 2, "fsdp": 2, "tensor": 2}
    state = engine.prefill([[5, 6, 7], [8, 9]])
    kv = P(("data", "fsdp"), "tensor", None, None)
    assert all(x.sharding.spec == kv for x in (*state.cache.k, *state.cache.v))
    assert state.cache.end.sharding.spec == P(("data", "fsdp"))
    assert state.cache.k[0].shape[0] == 4  # 2 contexts padded to split over data x fsdp
    reading = engine.read(state, [0, 0, 1], [[10, 11], [12], [13, 14, 15]])
    assert all(x.sharding.spec == kv for x in (*reading.cache.k, *reading.cache.v))


def test_bfloat16_parameters_cache_and_float32_scores(folder, reference):
    engine, tok = engine_for(folder, "2,1,4", dtype="bfloat16")
    assert {leaf.dtype for leaf in jax.tree.leaves(engine.params)} == {np.dtype("bfloat16")}
    state = engine.prefill([[5, 6, 7]])
    assert state.cache.k[0].dtype == np.dtype("bfloat16") and state.retrieve_logprobs.dtype == np.float32
    got = runs(engine, tok)["always"]
    want = reference["always"]
    # A random model's near-ties can flip in bfloat16; the scores stay close.
    for g, w in zip(got, want):
        for gc, wc in zip(g["candidates"], w["candidates"]):
            assert gc["scores"]["rel"] == pytest.approx(wc["scores"]["rel"], abs=0.05)


def test_a_mesh_that_does_not_split_the_model_names_the_config_value(folder):
    config = load_model(folder)[0].replace(num_kv_heads=4, num_heads=8)
    with pytest.raises(ValueError, match="num_kv_heads"):
        Placement(sharding.make_mesh("1,1,8")).params(config)


@pytest.mark.parametrize("rules", ["default", "head_dim_split"])
def test_placed_loading_equals_host_loading(folder, rules):
    """Each device's part read from the safetensors file equals the host-loaded tensor's part,
    for the contiguous ranges of the default rules and for a split that is not contiguous in
    HF's layout (head_dim over tensor reads the group whole, then slices)."""
    table = sharding.DEFAULT_RULES if rules == "default" else (("head_dim", "tensor"),) + tuple(
        r for r in sharding.DEFAULT_RULES if r[0] not in ("head_dim", "heads", "kv_heads"))
    placement = Placement(sharding.make_mesh("1,2,4"), table)
    _, host, _, _ = load_model(folder)
    _, placed, _, _ = load_model(folder, shardings=placement.params)
    for (path, want), got in zip(jax.tree_util.tree_flatten_with_path(host)[0], jax.tree.leaves(placed)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=jax.tree_util.keystr(path))
    assert placed["layers"]["attn"]["wq"].sharding.spec[-1] == ("tensor" if rules != "default" else None)


def test_server_shapes_on_a_mesh_compile_once_and_decide_the_same(folder, reference):
    """`serve`'s fixed shapes on a mesh: warm_up compiles every program, the questions then
    compile nothing more, and every decision equals the single-device engine's."""
    placement = Placement(sharding.make_mesh("2,1,4"))
    config, params, tok, _ = load_model(folder, shardings=placement.params)
    shapes = Shapes(questions=8, ndocs=5, prompt_tokens=64, suffix_tokens=96, min_rows=16, min_suffix=96)
    engine = Engine(params, config, ControlIds.from_tokenizer(tok), MAX_NEW, placement, shapes)
    assert engine.warm_up() == len(shapes.prompt_ladder) * (1 + len(shapes.segment_shapes))
    warmed = engine.compiled_programs()
    sf = ShortForm(engine, tok, GenerateOptions(trace=True, retrieve=RetrieveOptions(mode="always")))
    got = [output_record(r, sf.opts) for r in sf.run(make_items(5, seed=3))]
    assert engine.compiled_programs() == warmed
    for a, b in zip(got, reference["always"]):
        fa, fb = [], []
        assert split(a, fa) == split(b, fb)
        np.testing.assert_allclose(fa, fb, atol=1e-5)
