"""Sharded forward on 8 virtual CPU devices equals the unsharded one; the rules table is
what places every parameter (golden), and a mesh that does not divide fails by name."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from selfrag_jax import sharding
from selfrag_jax.models.config import preset
from selfrag_jax.models.llama import Llama, init_params, param_shardings

CONFIG = preset("tiny")

GOLDEN = {  # scanned layout: the leading "layers" axis is replicated
    "embedding": P("tensor", "fsdp"),
    "lm_head": P("fsdp", "tensor"),
    "final_norm/scale": P(None),
    "layers/attn/wq": P(None, "fsdp", "tensor", None),
    "layers/attn/wk": P(None, "fsdp", "tensor", None),
    "layers/attn/wv": P(None, "fsdp", "tensor", None),
    "layers/attn/wo": P(None, "tensor", None, "fsdp"),
    "layers/mlp/gate": P(None, "fsdp", "tensor"),
    "layers/mlp/up": P(None, "fsdp", "tensor"),
    "layers/mlp/down": P(None, "tensor", "fsdp"),
    "layers/attn_norm/scale": P(None, None),
    "layers/mlp_norm/scale": P(None, None),
}


def _flat(tree):
    return {"/".join(k.key for k in path): v for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() == 8, "tests run with 8 virtual CPU devices (conftest)"
    return sharding.make_mesh("2,2,2")


def test_parameter_shardings_follow_the_rules_table(mesh):
    shardings = _flat(param_shardings(CONFIG, mesh))
    assert {k: v.spec for k, v in shardings.items()} == GOLDEN
    params = init_params(CONFIG, 0, shardings=param_shardings(CONFIG, mesh))
    for name, leaf in _flat(params).items():
        assert leaf.sharding.spec == GOLDEN[name], name
    # Real placement: the embedding's vocab rows are split over `tensor`, its columns over `fsdp`.
    emb = _flat(params)["embedding"]
    assert {s.data.shape for s in emb.addressable_shards} == {(CONFIG.vocab_size // 2, CONFIG.hidden_size // 2)}


def test_sharded_forward_equals_unsharded(mesh):
    params = init_params(CONFIG, 0)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CONFIG.vocab_size, (4, 24)).astype(np.int32)
    seg = np.ones_like(tokens)
    seg[1, 15:] = 0
    ref, _ = jax.jit(lambda p, t, s: Llama(CONFIG).apply({"params": p}, t, segment_ids=s))(params, tokens, seg)

    shards = param_shardings(CONFIG, mesh)
    sharded_params = jax.device_put(params, shards)
    batch = sharding.logical_sharding(mesh, ("activation_batch", "activation_length"))

    @jax.jit
    def fwd(p, t, s):
        with nn.logical_axis_rules(sharding.DEFAULT_RULES):
            return Llama(CONFIG).apply({"params": p}, t, segment_ids=s)[0]

    with jax.set_mesh(mesh):  # the mesh that logical constraints resolve against
        out = fwd(sharded_params, jax.device_put(tokens, batch), jax.device_put(seg, batch))
    assert out.sharding.spec == P(("data", "fsdp"), None, "tensor")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=0)


def test_mesh_that_does_not_divide_names_the_config_value(mesh):
    with pytest.raises(ValueError, match=r"kv_heads=2\) is not divisible by mesh axes tensor=4; change model\.num_kv_heads"):
        param_shardings(CONFIG, sharding.make_mesh("1,2,4"))
    with pytest.raises(ValueError, match="has 6 devices but 8 are available"):
        sharding.make_mesh("2,3,1")
    assert sharding.parse_mesh_spec("data=2,fsdp=-1", 8) == {"data": 2, "fsdp": 4, "tensor": 1}
    assert sharding.parse_mesh_spec((8, 1, 1), 8) == {"data": 8, "fsdp": 1, "tensor": 1}


def test_rules_from_yaml_lists():
    rules = sharding.rules_from_config([["embed", ["data", "fsdp"]], ["mlp", None]])
    assert rules == (("embed", ("data", "fsdp")), ("mlp", None))
    with pytest.raises(ValueError, match="mesh axis 'model'"):
        sharding.rules_from_config([["mlp", "model"]])


def test_split_host_cpu_sets_the_device_count_only_before_jax_starts(monkeypatch):
    import os
    import subprocess
    import sys

    from jax._src import xla_bridge

    from selfrag_jax import distributed

    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    assert distributed.split_host_cpu(2)
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=2"
    assert not distributed.split_host_cpu(3)  # a count already in XLA_FLAGS decides
    monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    assert not distributed.split_host_cpu(2) and "XLA_FLAGS" not in os.environ  # too late: left alone
    # end to end in a fresh process: the CPU platform comes up with two devices
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    code = "from selfrag_jax.distributed import split_host_cpu; split_host_cpu(); import jax; print(jax.device_count())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "2"


def test_checkpoint_saved_on_a_mesh_loads_in_a_one_device_process(mesh, tmp_path):
    """A model trained over 8 devices (a pod, or the two-device CPU default) loads where only
    one exists (a laptop's `generate`): Orbax must not insist on the saved topology."""
    import os
    import subprocess
    import sys

    from selfrag_jax.models.checkpoint import save_model

    params = init_params(CONFIG, 0, shardings=param_shardings(CONFIG, mesh))
    save_model(tmp_path / "model", params, CONFIG)
    np.save(tmp_path / "embedding.npy", np.asarray(params["embedding"]))
    code = ("import jax, numpy as np, sys; from selfrag_jax.models.checkpoint import load_model; "
            "c, p, _, _ = load_model(sys.argv[1]); assert jax.device_count() == 1; "
            "np.testing.assert_array_equal(np.asarray(p['embedding']), np.load(sys.argv[2])); print('ok')")
    env = os.environ | {"XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "model"), str(tmp_path / "embedding.npy")],
                         env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
