"""`selfrag-jax plan`: target names, ahead-of-time memory plans through libtpu, suggestions;
and `bench/gpu_check.py --small` on the CPU.

The compiling tests need libtpu (`pip install '.[tpu]'`) and skip without it; the name
mapping and the GPU estimate need nothing but this package.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from selfrag_jax.cli import main as cli_main
from selfrag_jax.chips import GiB
from selfrag_jax.plan import candidate_changes, parse_target, plan, plan_model_config, slice_shape
from selfrag_jax.training.config import load_config

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model.preset=tiny", "data.seq_len=128", "global_batch_size=8"]
# Tiny weights, but 48 layers of 1,024-token attention without remat: the saved activations
# overflow a v5e chip; remat_policy=full fits.
OVERSIZED = ["model.preset=tiny", "model.overrides={num_layers: 48}", "data.seq_len=1024", "global_batch_size=64"]


@pytest.fixture(autouse=True)
def default_matmul_precision():
    """Plan what `train` compiles: conftest's "highest" precision (for CPU parity tests) would
    turn every float32 TPU matmul into a multi-pass one and slow these compiles ten-fold."""
    import jax

    previous = jax.config.jax_default_matmul_precision
    jax.config.update("jax_default_matmul_precision", None)
    yield
    jax.config.update("jax_default_matmul_precision", previous)


def needs_libtpu():
    pytest.importorskip("libtpu", reason="AOT plans for TPUs need libtpu: pip install '.[tpu]'")


# --- target names ---------------------------------------------------------------------
@pytest.mark.parametrize("spec, topology, chips", [
    ("v5p-32", "v5p:2x2x4", 16), ("v5p-64", "v5p:2x4x4", 32), ("v5p-8", "v5p:2x2x1", 4),
    ("v4-32", "v4:2x2x4", 16), ("v4-16", "v4:2x2x2", 8), ("v5e-64", "v5e:8x8", 64), ("v5e-16", "v5e:4x4", 16),
    ("v5e-8", "v5e:2x4", 8), ("v5e-4", "v5e:2x2", 4), ("v5litepod-16", "v5e:4x4", 16), ("v6e-16", "v6e:4x4", 16),
    ("v5e-256", "v5e:16x16", 256), ("v5p-1024", "v5p:8x8x8", 512), ("V5P:2x2x4", "v5p:2x2x4", 16),
    ("v5e:8x8", "v5e:8x8", 64),
])
def test_product_names_map_to_libtpu_topologies(spec, topology, chips):
    target = parse_target(spec)
    assert (target.topology, target.num_chips, target.chip.kind) == (topology, chips, "tpu")


def test_topology_names_keep_product_names_and_hbm():
    assert parse_target("v5p:2x2x4").spec == "v5p-32"
    assert parse_target("v4:2x2x4").chip.chip_config == "megacore"  # one device per v4 chip, 32 GiB
    assert {parse_target(s).chip.hbm_bytes // GiB for s in ("v4-8", "v5e-4", "v5p-8", "v6e-4")} == {32, 16, 95}
    assert parse_target("v5e-4").scaled(4).spec == "v5e-16"
    assert parse_target("v5p-32").scaled(2).spec == "v5p-64"


@pytest.mark.parametrize("spec, chips, name", [("8x h100", 8, "h100"), ("4X A100", 4, "a100"), ("h200", 1, "h200"),
                                               ("16 x h100", 16, "h100")])
def test_gpu_specs(spec, chips, name):
    target = parse_target(spec)
    assert (target.num_chips, target.chip.name, target.chip.kind, target.topology) == (chips, name, "gpu", None)


@pytest.mark.parametrize("spec", ["v5p-33", "v5p-6", "v9-8", "tpu", "v5e:2x2x2", "v5p:2x2", "8x tpu", "v5e-12", ""])
def test_bad_specs_fail_with_one_line(spec, capsys):
    with pytest.raises(ValueError) as err:
        parse_target(spec)
    assert "\n" not in str(err.value)
    assert cli_main(["plan", "/dev/null", "--mesh", spec]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("selfrag-jax plan: error:"), lines


def test_slice_shapes_double_the_last_smallest_dim():
    assert [slice_shape(n, 3) for n in (4, 8, 16, 32, 64, 128)] == [
        (2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4), (4, 4, 4), (4, 4, 8)]
    assert [slice_shape(n, 2) for n in (1, 4, 8, 16, 32, 64, 128)] == [
        (1, 1), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16)]


def test_model_shape_comes_from_the_preset_when_init_from_is_absent():
    cfg = load_config(ROOT / "configs/tpu/generator_7b_v5p-32.yaml")
    config = plan_model_config(cfg)
    assert (config.vocab_size, config.num_layers, config.remat_policy, config.dtype) == (32016, 32, "full", "bfloat16")
    with pytest.raises(ValueError, match="model.preset=selfrag-7b"):
        plan_model_config(load_config(ROOT / "configs/generator_7b.yaml"))


def test_model_shape_comes_from_init_from_config_without_weights(tmp_path):
    from selfrag_jax.models.config import preset, to_hf_dict

    (tmp_path / "config.json").write_text(json.dumps(to_hf_dict(preset("llama2-7b"))))
    cfg = load_config(None, [f"model.init_from={tmp_path}", "model.overrides={remat_policy: full}"])
    config = plan_model_config(cfg)
    assert (config.vocab_size, config.hidden_size, config.remat_policy) == (32016, 4096, "full")


def test_candidate_changes_are_cumulative_and_cheap_first():
    cfg = load_config(None, ["model.preset=llama2-7b", "mesh=2,-1,1", "global_batch_size=16"])
    changes = candidate_changes(cfg, parse_target("v5e-4"), plan_model_config(cfg))
    labels = [label for label, _ in changes]
    assert labels[:3] == ["remat_policy=full", "FSDP over all chips (mesh=1,-1,1)",
                          "micro_batch_size=8 (2 accumulation steps)"]
    assert changes[2][1] == ["model.overrides.remat_policy=full", "mesh=1,-1,1", "micro_batch_size=8"]
    assert labels[-2:] == ["a bigger slice: v5e-8", "a bigger slice: v5e-16"]
    # One sequence per chip per micro-step, as the last micro-batch tried on v5e-4.
    assert changes[-2][1][-2:] == ["micro_batch_size=8", "@v5e-8"] and "micro_batch_size=16" not in changes[-1][1]


def test_gpu_plan_is_an_analytic_estimate():
    p = plan(None, "8x h100", ["model.preset=llama2-7b", "model.overrides={dtype: bfloat16, remat_policy: full}",
                               "data.seq_len=2048", "global_batch_size=64"])
    assert p.train.estimated and p.decode.estimated and p.chips == 8
    assert p.train.parameters == pytest.approx(4 * 6.74e9 / 8, rel=0.01)
    assert p.train.fits  # 7B with full remat, 8 x 2048 tokens per 80 GiB GPU
    assert p.analytics["step_s_at_50pct_mfu"] > 0


# --- ahead-of-time plans through libtpu -----------------------------------------------
def test_small_model_plans_and_fits_on_v5e_2x2():
    needs_libtpu()
    p = plan(None, "v5e:2x2", SMALL)
    assert p.fits and p.chips == 4 and p.mesh == {"data": 1, "fsdp": 4, "tensor": 1}
    t = p.train
    assert t.parameters > 0 and t.optimizer_state == pytest.approx(2 * t.parameters, rel=0.01)
    assert t.arguments >= t.parameters + t.optimizer_state and t.total > 0 and t.error is None
    assert t.total < t.hbm == 16 * GiB
    assert p.decode.kv_cache > 0 and p.decode.total > p.decode.kv_cache
    assert p.analytics["model_flops_per_step"] > 0


def test_oversized_config_does_not_fit_and_gets_a_change_that_fits(capsys):
    needs_libtpu()
    rc = cli_main(["plan", "/dev/null", *OVERSIZED, "--mesh", "v5e-4", "--json", "--no-decode"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1 and not out["fits"]
    assert out["train"]["total"] > 16 * GiB * 0.9 or out["train"]["error"]
    suggestion = out["suggestion"]
    assert suggestion["change"] == "remat_policy=full"
    assert suggestion["overrides"] == ["model.overrides.remat_policy=full"] and suggestion["plan"]["fits"]
    assert [t["change"] for t in out["tried"]] == ["remat_policy=full"] and out["tried"][0]["fits"]


def test_state_that_cannot_fit_skips_the_compile_and_asks_for_more_chips():
    needs_libtpu()
    p = plan(None, "v5e-4", ["model.preset=llama2-7b", "global_batch_size=8"], with_decode=False)
    assert not p.fits and p.train.error.startswith("parameters, gradients and optimizer state alone need")
    assert p.train.total > 16 * GiB and p.train.compile_s == 0


def test_table_output_and_exit_status(capsys):
    needs_libtpu()
    assert cli_main(["plan", "/dev/null", *SMALL, "--mesh", "v5e-4"]) == 0
    text = capsys.readouterr().out
    assert "per chip" in text and "fits (10% margin)" in text and "decode step (batch 4)" in text


@pytest.mark.slow
def test_real_7b_generator_plans_on_v5p_32():
    needs_libtpu()
    p = plan(str(ROOT / "configs/tpu/generator_7b_v5p-32.yaml"), "v5p-32", with_decode=False)
    assert p.fits and p.chips == 16 and p.mesh["fsdp"] == 16
    # 6.74B float32 parameters over 16 chips, Adam's two moments twice that.
    assert p.train.parameters == pytest.approx(4 * 6.74e9 / 16, rel=0.02)
    assert 8 * GiB < p.train.total < 95 * GiB * 0.9


# --- bench/gpu_check.py ---------------------------------------------------------------
def test_gpu_check_runs_small_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    result = subprocess.run([sys.executable, str(ROOT / "bench/gpu_check.py"), "--small", "--out", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["platform"] == "cpu" and report["train"]["finite"] and report["train"]["mfu"] > 0
    assert report["decode"]["tokens_per_s"] > 0 and report["decode"]["all_rows_full"]
    assert report["parity"]["max_abs_diff"] == 0.0  # both sides are the CPU here


# --- serving: the engine's own programs -------------------------------------------------
def serve_yaml(tmp_path, **fields) -> str:
    import yaml

    serve = {"model": "tiny", "mesh": "4,1,2", "questions": 4, "ndocs": 5, "prompt_tokens": 40,
             "passage_tokens": 60, "max_new_tokens": 16, **fields}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump({"serve": serve}))
    return str(path)


def test_serve_plan_compiles_the_engines_prefill_and_decode_for_a_tpu(tmp_path):
    needs_libtpu()
    from selfrag_jax.plan import plan_serve

    p = plan_serve(serve_yaml(tmp_path), "v5e-8", search=False)
    assert set(p.programs) == {"prefill", "decode"} and p.fits and p.mesh == {"data": 4, "fsdp": 1, "tensor": 2}
    prefill, decode = p.programs["prefill"], p.programs["decode"]
    assert not decode.estimated and decode.total > 0 and decode.compile_s > 0
    # the engine's buckets: 20 candidate rows (4 x 5, split over data=4), suffix 60 + 3 markers -> 64
    assert (p.analytics["candidate_rows"], p.analytics["suffix_len"], p.analytics["context_rows"]) == (20, 64, 4)
    assert decode.kv_cache > prefill.kv_cache > 0  # the candidates' cache on top of the contexts'
    assert decode.parameters == prefill.parameters > 0


def test_serve_plan_finds_the_largest_question_batch_that_fits(tmp_path):
    """An 80 GB GPU (analytic): a batch that overflows is reported with the one that fits."""
    from selfrag_jax.plan import plan_serve, serve_table

    path = serve_yaml(tmp_path, model="selfrag-13b", mesh="1,1,1", dtype="bfloat16", questions=512,
                      prompt_tokens=512, passage_tokens=512, max_new_tokens=200)
    p = plan_serve(path, "h100")
    assert not p.fits and p.programs["decode"].estimated
    assert 1 <= p.largest_questions < 512 and p.tried[p.largest_questions] and not p.tried[2 * p.largest_questions]
    assert f"the largest that fits: {p.largest_questions}" in serve_table(p)
    small = plan_serve(path, "h100", ["serve.questions=1"], search=False)
    assert small.fits and small.programs["decode"].parameters == pytest.approx(13.0e9 * 2, rel=0.02)


def test_serve_config_errors_name_the_field(tmp_path):
    from selfrag_jax.plan import ServeConfig

    with pytest.raises(ValueError, match="serve.batch is not a serving field"):
        ServeConfig.load(serve_yaml(tmp_path, batch=3))
    with pytest.raises(ValueError, match="serve.ndocs must be"):
        ServeConfig.load(serve_yaml(tmp_path, ndocs=0))


def test_shipped_serving_configs_load():
    from selfrag_jax.plan import ServeConfig, is_serve_config, parse_target, serve_model_config

    paths = sorted((ROOT / "configs" / "serve").glob("*.yaml"))
    assert len(paths) >= 4
    for path in paths:
        assert is_serve_config(str(path))
        serve = ServeConfig.load(str(path))
        assert serve.dtype == "bfloat16" and serve_model_config(serve).param_dtype == "bfloat16"
        parse_target(path.stem.split("_")[-1])
