"""The reference runner: the Hugging Face modules behind the runner protocol (loading.Runner), for verification and
for the architectures the fast runner (llama.py) does not cover."""

from __future__ import annotations

from typing import Any

import torch

from model_runner.llama import DecodeBatch
from model_runner.paged_cache import PagedHFCache, PagedKVCache


class ReferenceRunner:
    name = "hf"
    replays = False  # its passes round a row differently from the decode steps that made it (forward.replay_pass)

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model, self.device = model, device

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, lengths: list[int], start: int, cache: Any) -> torch.Tensor:
        width = input_ids.shape[1]
        lasts = [length - 1 for length in lengths]
        keep = sorted(set(lasts))
        out = self.model(
            input_ids=input_ids,
            position_ids=torch.arange(start, start + width, device=self.device)[None],
            past_key_values=cache,
            use_cache=True,
            # every row's last position (one index when all prompts are as long as the longest)
            logits_to_keep=1 if keep == [width - 1] else torch.tensor(keep, device=self.device),
        )
        rows = torch.arange(len(lengths))
        return out.logits[rows, torch.tensor([keep.index(last) for last in lasts])]

    def replay(self, input_ids: torch.Tensor, start: int, cache: Any) -> torch.Tensor:
        raise NotImplementedError("the reference runner does not replay decoded tokens (replays is False)")

    @torch.inference_mode()
    def step(self, input_ids: torch.Tensor, batch: DecodeBatch, cache: PagedKVCache) -> torch.Tensor:
        paged = PagedHFCache(cache, batch)
        out = self.model(input_ids=input_ids[:, None], position_ids=batch.positions[:, None],
                         attention_mask=paged.mask(), past_key_values=paged, use_cache=True)
        return out.logits[:, -1]
