"""`selfrag-jax convert hf-to-ckpt | ckpt-to-hf | gguf-to-ckpt`: lossless conversion both ways.

hf-to-ckpt keeps the original config and tensor dtypes (hf_meta.json) so that ckpt-to-hf
writes back the same config and bit-identical tensors. The tokenizer is stored as is; the
reflection tokens are added when the model is loaded for Self-RAG, not at conversion.
gguf-to-ckpt dequantizes a llama.cpp file to float32 and rebuilds its tokenizer from the
file's metadata (`models.gguf`); ckpt-to-hf then writes the HF folder it stands for.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    if name.endswith("gguf-to-ckpt"):
        parser.add_argument("gguf_file", help="Llama-architecture GGUF file (llama.cpp)")
        parser.add_argument("out", help="output checkpoint folder")
        parser.add_argument("--no-scan", action="store_true", help="store layers unstacked (default: scanned)")
    elif name.endswith("hf-to-ckpt"):
        parser.add_argument("hf_dir", help="Hugging Face Llama folder (config.json, *.safetensors, tokenizer files)")
        parser.add_argument("out", help="output checkpoint folder")
        parser.add_argument("--no-scan", action="store_true", help="store layers unstacked (default: scanned)")
    else:
        parser.add_argument("ckpt", help="selfrag-jax model checkpoint (or training run / step folder)")
        parser.add_argument("out", help="output Hugging Face folder")
        parser.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size [5]")


def hf_to_ckpt(hf_dir: str, out: str, scan_layers: bool = True) -> Path:
    from selfrag_jax.models.checkpoint import save_model
    from selfrag_jax.models.hf import load_hf

    config, params, meta = load_hf(hf_dir, scan_layers=scan_layers)
    return save_model(out, params, config, tokenizer_files=hf_dir, hf_meta=meta)


def gguf_to_ckpt(gguf_file: str, out: str, scan_layers: bool = True) -> Path:
    from selfrag_jax.models.checkpoint import save_model
    from selfrag_jax.models.hf import open_source, read_host

    source = open_source(gguf_file)
    config = source.config(scan_layers=scan_layers)
    params, meta = read_host(source, config)
    with tempfile.TemporaryDirectory(prefix="selfrag-gguf-tok-") as tok_dir:
        source.reader.tokenizer().save_pretrained(tok_dir)  # as is, like hf-to-ckpt's
        return save_model(out, params, config, tokenizer_files=tok_dir, hf_meta=meta)


def ckpt_to_hf(ckpt: str, out: str, max_shard_bytes: int = 5 * 2**30) -> Path:
    from selfrag_jax.models.checkpoint import load_model, resolve_model_dir
    from selfrag_jax.models.hf import export_hf

    config, params, _, meta = load_model(ckpt, add_control_tokens=False)
    folder = resolve_model_dir(ckpt)
    tok_dir = folder / "tokenizer" if (folder / "tokenizer").exists() else None
    export_hf(params, config, out, meta=meta, tokenizer_dir=tok_dir, max_shard_bytes=max_shard_bytes)
    return Path(out)


def run(args: argparse.Namespace) -> int:
    if args._name.endswith("gguf-to-ckpt"):
        out = gguf_to_ckpt(args.gguf_file, args.out, scan_layers=not args.no_scan)
    elif args._name.endswith("hf-to-ckpt"):
        out = hf_to_ckpt(args.hf_dir, args.out, scan_layers=not args.no_scan)
    else:
        out = ckpt_to_hf(args.ckpt, args.out, max_shard_bytes=int(args.max_shard_gb * 2**30))
    print(f"wrote {out}")
    return 0
