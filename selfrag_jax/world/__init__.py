"""A bundled, deterministic fictional world for demonstrating Self-RAG at laptop scale.

Invented people (with look-alikes and a held-out split), their encyclopedia passages, and
everything derived from them: Self-RAG generator data with oracle reflection tokens, raw
instruction-output pairs for the annotation pipeline, critic data for each token type,
base-model pretraining text, eval sets in the released layout, and a small BPE tokenizer.
Pure Python; `tokenizers` is imported only when a tokenizer is trained.
"""

from .build import TASK_MIX, WorldConfig, build_world
from .core import World, make_world
from ..data.critic_prompts import critic_prompt
from .critic_data import make_critic_records
from .generator_data import GeneratorConfig, ParsedOutput, ParsedSegment, make_generator_example, oracle_output, parse_output
from .kb import ATTRIBUTES, KnowledgeBase, Person, make_knowledge_base
from .passages import WorldPassage, read_jsonl, write_jsonl
from .pretrain import PretrainConfig, pretrain_texts
from .tasks import REFUSAL, Task, TaskMaker, factcheck_instruction, mc_instruction
from .tokenizer import train_tokenizer

__all__ = [
    "ATTRIBUTES", "REFUSAL", "TASK_MIX", "GeneratorConfig", "KnowledgeBase", "ParsedOutput", "WorldPassage", "Person",
    "PretrainConfig", "ParsedSegment", "Task", "TaskMaker", "World", "WorldConfig", "build_world", "critic_prompt",
    "factcheck_instruction", "make_critic_records", "make_generator_example", "make_knowledge_base", "make_world",
    "mc_instruction", "oracle_output", "parse_output", "pretrain_texts", "read_jsonl", "train_tokenizer", "write_jsonl",
]
