"""Training data: Self-RAG JSON lines -> tokenized, loss-masked, packed numpy batches.

Two paths give identical batches for the same config: the pure-Python/numpy one (default;
no TensorFlow, used on GPU machines and by the embedded default) and the seqio + TFDS one
(`backend="seqio"`, module `seqio_tasks`, which imports TensorFlow only when used).

    cfg = DataConfig(tasks=(generator_task("train.jsonl"),), batch_size=8, seq_len=2048)
    it = batches(cfg, tokenizer)            # dicts with keys BATCH_KEYS
    pos = it.state()                        # JSON-able; batches(cfg, tokenizer, state=pos) resumes
"""

from .encode import Example, MaskConfig, SpecialIds, assemble, encode_record, passage_content
from .pack import BATCH_KEYS, Packer
from .config import DataConfig, TaskSpec, critic_tasks, generator_task
from .pipeline import DataIterator, JsonlSource, Order, batches, config_dict, make_sources
from .records import CRITIC_TYPES, JsonlIndex, RecordError, critic_type, iter_records, parse_record

__all__ = [
    "BATCH_KEYS", "CRITIC_TYPES", "DataConfig", "DataIterator", "Example", "JsonlIndex", "JsonlSource", "MaskConfig",
    "Order", "Packer", "RecordError", "SpecialIds", "TaskSpec", "assemble", "batches", "config_dict", "critic_tasks",
    "critic_type", "encode_record", "generator_task", "iter_records", "make_sources", "parse_record",
    "passage_content",
]
