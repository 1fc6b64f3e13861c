"""The real default model (SmolLM2-135M-Instruct), disaggregated and colocated, against Hugging Face generate."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pdserve.client import generate
from tests.helpers import assert_nothing_held, hf_greedy, start_cluster

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n",
    "Once upon a time, in a small village nestled between two mountains, there lived an old clockmaker who " * 4,
]


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_default_model_greedy_matches_hugging_face_concurrently(default_model_dir: Path, mode: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    # Colocated: the decode worker prefills in chunks of 16 tokens, so the long prompts take several chunks.
    cluster = (start_cluster(default_model_dir) if mode == "disaggregated" else
               start_cluster(default_model_dir, prefill=0, decode_args=("--prefill-chunk=16",)))
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            completions = list(pool.map(lambda p: generate(cluster.gateway.address, timeout=300, prompt=p,
                                                           max_tokens=20, temperature=0.0), PROMPTS))
        for prompt, completion in zip(PROMPTS, completions):
            expected = hf_greedy(default_model_dir, tokenizer(prompt).input_ids, 20)
            assert completion.token_ids == expected, prompt
        assert "Paris" in completions[0].text
        assert_nothing_held(cluster)
    finally:
        cluster.stop()
