"""Prompt datasets and the seeded, resumable prompt sampler (see docs/data.md).

records = load_prompts(["prompts.jsonl"], prompt_key="prompt")   # list[PromptRecord]
sampler = PromptSampler(records, batch_size=8, seed=42)
batch = sampler.next_batch()                                     # [(index, PromptRecord), ...]
state = sampler.state_dict()                                     # {"epoch", "position", ...}
"""

from diffrl.data.prompts import SUPPORTED_EXTENSIONS, PromptRecord, load_prompts
from diffrl.data.sampler import PromptSampler

__all__ = ["SUPPORTED_EXTENSIONS", "PromptRecord", "PromptSampler", "load_prompts"]
