"""`selfrag-jax train CONFIG [key=value ...]`: one command for critic, generator and base model."""

from __future__ import annotations

import argparse

import jax


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML under configs/ (e.g. configs/generator_tiny.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides, e.g. optim.learning_rate=1e-5 mesh=data=2,fsdp=-1")


def make_data(cfg, tokenizer, model_config, split: str = "train"):
    """(data source, number of examples or None) for this host's share of the data."""
    if cfg.data.task == "synthetic":
        from selfrag_jax.training.synthetic import SyntheticData

        return SyntheticData(model_config.vocab_size, cfg.data.seq_len,
                             cfg.global_batch_size, cfg.data.seed + (split != "train"),
                             jax.process_index(), jax.process_count()), None
    from selfrag_jax.data import make_training_source

    return make_training_source(cfg, tokenizer, split=split)


def run(args: argparse.Namespace) -> int:
    from selfrag_jax import distributed
    from selfrag_jax.training.config import load_config
    from selfrag_jax.training.trainer import Trainer, build_model, resolve_num_steps, write_run_config

    distributed.initialize()
    cfg = load_config(args.config, args.overrides)
    model_config, init_params, tokenizer = build_model(cfg)
    data, n_examples = make_data(cfg, tokenizer, model_config)
    eval_data = make_data(cfg, tokenizer, model_config, split="eval")[0] if cfg.data.eval_files else None
    num_steps = resolve_num_steps(cfg, n_examples)
    write_run_config(cfg, model_config)
    trainer = Trainer(cfg, model_config, tokenizer, init_params)
    final = trainer.fit(data, num_steps, eval_data)
    if distributed.is_main() and final:
        print(f"step {final['step']}: loss {final['loss']:.4f}, {final['tokens_per_s']:.0f} tokens/s, "
              f"MFU {final['mfu']:.1%}; checkpoints in {cfg.run_dir}/checkpoints")
    return 0
