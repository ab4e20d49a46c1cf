"""`selfrag-jax train CONFIG [key=value ...]`: one command for critic, generator and base model."""

from __future__ import annotations

import argparse
from pathlib import Path

import jax


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML under configs/ (e.g. configs/generator_tiny.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="dotted overrides, e.g. optim.learning_rate=1e-5 mesh=data=2,fsdp=-1")


def make_data(cfg, tokenizer, model_config, split: str = "train"):
    """(this host's data stream, number of records or None) for the config's task."""
    if cfg.data.task == "synthetic":
        from selfrag_jax.training.synthetic import SyntheticData

        return SyntheticData(model_config.vocab_size, cfg.data.seq_len, cfg.global_batch_size,
                             cfg.data.seed + (split != "train"), jax.process_index(), jax.process_count()), None
    from selfrag_jax import data as D

    if tokenizer is None:
        raise ValueError("training on real data needs a tokenizer: set model.tokenizer (or a model.init_from with one)")
    d = cfg.data
    files = d.train_files if split == "train" else d.eval_files
    if not files:
        raise ValueError(f"data.{split}_files is empty")
    rates = d.mixture_rates
    stems = [Path(f).stem for f in files] if d.task == "pretrain" else []
    unknown = sorted(set(rates) - {"generator", "critic", *D.CRITIC_TYPES, *stems})
    if unknown:
        raise ValueError(f"data.mixture_rates: unknown key(s) {unknown}; keys are generator, critic, the "
                         f"critic types {list(D.CRITIC_TYPES)} and, for task pretrain, the train files' stems")
    tasks: list = []
    for i, path in enumerate(files):
        if d.task in ("generator", "mixture"):
            tasks.append(D.generator_task(path, rate=rates.get("generator", 1.0), name=f"generator{i}"))
        elif d.task == "critic":
            tasks.extend(D.critic_tasks(path, prefix=f"critic{i}", type_rates=rates))
        elif d.task == "pretrain":
            tasks.append(D.TaskSpec(f"text{i}", str(path), "text", rate=rates.get(stems[i], 1.0)))
        else:
            raise ValueError(f"data.task={d.task!r} must be generator, critic, mixture, pretrain or synthetic")
    if d.task == "mixture":
        for i, path in enumerate(d.critic_files):
            tasks.extend(D.critic_tasks(path, rate=rates.get("critic", 1.0), prefix=f"critic{i}", type_rates=rates))
    mask = D.MaskConfig(masking=d.masking, prompt_off_by_one=d.prompt_off_by_one,
                        passage_loss_weight=d.passage_loss_weight, unsupported_weight=d.unsupported_weight,
                        unhelpful_weight=d.unhelpful_weight)
    data_cfg = D.DataConfig(tasks=tuple(tasks), batch_size=cfg.global_batch_size // jax.process_count(),
                            seq_len=d.seq_len, pack=d.packing, seed=d.seed + (split != "train"), mask=mask)
    stream = D.batches(data_cfg, tokenizer, backend="numpy" if d.backend == "auto" else d.backend)
    return stream, sum(len(s) for s in stream.sources)


def examples_per_batch(stream) -> float:
    """Packed examples in one global batch, measured on the first batch (then rewound)."""
    start = stream.state()
    batch = next(iter(stream))
    stream.restore(start)
    rows = batch["segment_ids"]
    return float(sum(len(set(r[r > 0].tolist())) for r in rows)) * jax.process_count()


def train(cfg) -> dict:
    """Model, data and steps from `cfg`, then the trainer; returns the last logged metrics.
    Shared by `selfrag-jax train` and the embedded default's pipeline. Stopped by SIGTERM
    (state saved), it raises SystemExit(143)."""
    from selfrag_jax.training.trainer import Trainer, build_model, resolve_num_steps, write_run_config

    model_config, init_params, tokenizer = build_model(cfg)
    data, n_examples = make_data(cfg, tokenizer, model_config)
    eval_data = make_data(cfg, tokenizer, model_config, split="eval")[0] if cfg.data.eval_files else None
    # epochs -> steps, counting the packed examples of a batch
    per_step = examples_per_batch(data) if n_examples and not cfg.num_steps else None
    num_steps = resolve_num_steps(cfg, n_examples, per_step)
    write_run_config(cfg, model_config)
    final = Trainer(cfg, model_config, tokenizer, init_params).fit(data, num_steps, eval_data)
    if final.get("preempted"):
        # Saved but not finished: exit 143, the shell's code for SIGTERM, never 0 (a
        # scheduler, tpu/retry.sh or the default pipeline would take 0 for done).
        raise SystemExit(143)
    return {**final, "num_steps": num_steps}


def run(args: argparse.Namespace) -> int:
    from selfrag_jax import distributed
    from selfrag_jax.training.config import load_config

    distributed.split_host_cpu()  # a CPU host: two XLA devices, as train-default (no-op on GPU/TPU hosts)
    distributed.initialize()
    cfg = load_config(args.config, args.overrides)
    final = train(cfg)
    if distributed.is_main() and "loss" in final:
        print(f"step {final['step']}: loss {final['loss']:.4f}, {final['tokens_per_s']:.0f} tokens/s, "
              f"MFU {final['mfu']:.1%}; checkpoints in {cfg.run_dir}/checkpoints")
    return 0
