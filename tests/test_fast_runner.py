"""The fast Llama runner: quality against Hugging Face, batch invariance, and the paged KV cache under it."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, DynamicCache

from engine.core import EngineCore
from engine.prompts import Prefilled
from model_runner import attention, forward, llama
from model_runner.forward import WatchedCache
from model_runner.loading import LoadedModel, ModelConfig, load_model
from model_runner.paged_cache import BLOCK_SIZE, OutOfBlocks, PagedKVCache, pieces_of
from model_runner.prefix_cache import PrefixCache
from pdserve.client import generate
from tests.helpers import (
    Recorder,
    assert_close,
    assert_nothing_held,
    greedy,
    hf_reference,
    save_random_llama,
    start_cluster,
)

QUALITY_PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n",
    "Once upon a time, in a small village nestled between two mountains, there lived",
    "<|im_start|>user\nName three colours of the rainbow.<|im_end|>\n<|im_start|>assistant\n",
    "The three laws of thermodynamics are",
    "import numpy as np\n\ndef mean_squared_error(y, y_hat):\n",
    "Dear hiring manager, I am writing to apply for the position of",
]


@pytest.mark.slow
def test_fast_runner_agrees_with_hugging_face_in_fp32_and_bf16(default_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    prompts = [tokenizer(p).input_ids for p in QUALITY_PROMPTS]
    steps = 64
    references = [hf_reference(default_model_dir, p, steps) for p in prompts]
    for dtype in ("float32", "bfloat16"):
        runner = load_model(default_model_dir, dtype, runner="fast")
        assert runner.fast is not None
        ours = greedy(runner, prompts, steps)
        agreed = [assert_close(o, r, f"{dtype} prompt {i}") for i, (o, r) in enumerate(zip(ours, references))]
        if dtype == "float32":  # a float32 divergence would be a bug, not rounding: all 8 x 64 tokens agree
            assert agreed == [steps] * len(prompts)


@pytest.fixture(scope="module")
def head64_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama with 64-wide heads, 3 q heads to each kv head, as SmolLM2 has (the prompt-attention
    kernel serves head dims that are multiples of 64; the session's tiny model has 16)."""
    return save_random_llama(tmp_path_factory.mktemp("head64-llama"), vocab_size=49152, hidden_size=192,
                             intermediate_size=1536, num_hidden_layers=2, num_attention_heads=3,
                             num_key_value_heads=1, head_dim=64, max_position_embeddings=512)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_sequence_gets_the_same_bits_alone_as_in_any_batch(head64_model_dir: Path, dtype: str) -> None:
    """Batch-invariant kernels: a prompt's logits and each decode step's are bit-identical whether it runs alone,
    batched with others (prefill or decode), or prefilled in chunks."""
    runner = ModelConfig(model=str(head64_model_dir), dtype=dtype, runner="fast").load()
    assert runner.fast is not None and runner.fast._causal_kernel  # the C++ kernels, not their fallbacks
    prompts = [[(i * 37 + j * 11) % 49000 + 10 for j in range(5 + 9 * i)] for i in range(6)]
    batched = forward.prefill_pass(runner, prompts, DynamicCache())
    alone = torch.cat([forward.prefill_pass(runner, [p], DynamicCache()) for p in prompts])
    assert torch.equal(batched, alone)
    for cut in (1, 16, 40):  # chunked prefill, and a prefix-cache hit continuing after `cut` cached tokens
        cache = DynamicCache()
        forward.prefill_pass(runner, [prompts[-1][:cut]], cache)
        assert torch.equal(forward.prefill_pass(runner, [prompts[-1][cut:]], cache)[0], alone[-1])

    steps = 6
    together = greedy(runner, prompts, steps)
    for prompt, result in zip(prompts, together):
        assert greedy(runner, [prompt], steps) == [result]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_decode_step_in_one_c_call_gives_the_python_loops_bits(
    head64_model_dir: Path, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """decode_layers (csrc/paged_attention.cpp) runs the layers' loop in C++: the same logits and the same KV
    written, bit for bit, as the Python loop it replaces on the CPU."""
    runner = ModelConfig(model=str(head64_model_dir), dtype=dtype, runner="fast").load()
    assert runner.fast is not None and runner.fast._layer_weights is not None
    assert attention.decode_layers_op(runner.device, runner.dtype) is not None
    prompts = [[(i * 53 + j * 7) % 49000 + 10 for j in range(3 + 11 * i)] for i in range(4)]

    def run() -> tuple[list[torch.Tensor], torch.Tensor]:
        spec = runner.spec
        cache = PagedKVCache(spec.num_layers, sum(-(-(len(p) + 8) // BLOCK_SIZE) for p in prompts),
                             spec.num_kv_heads, spec.head_dim, runner.dtype, runner.device)
        tables = []
        for prompt in prompts:
            _, kv = forward.prefill(runner, prompt)
            tables.append(cache.allocate(len(prompt) + 8))
            cache.load(tables[-1], pieces_of(kv), len(prompt))
        tokens, positions, steps = [5, 6, 7, 8], [len(p) for p in prompts], []
        for _ in range(6):
            steps.append(forward.decode_step(runner, cache, tokens, tables, positions).clone())
            tokens, positions = steps[-1].argmax(-1).tolist(), [p + 1 for p in positions]
        return steps, cache.kv.clone()

    in_c, kv_in_c = run()
    monkeypatch.setattr(llama, "decode_layers_op", lambda device, dtype: None)  # the Python loop
    in_python, kv_in_python = run()
    assert all(torch.equal(a, b) for a, b in zip(in_c, in_python))
    assert torch.equal(kv_in_c, kv_in_python)


def _decoded(runner: LoadedModel, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor],
                                                                          list[tuple[torch.Tensor, torch.Tensor]]]:
    """A prompt's greedy tokens as a decode worker makes them: prefill, then `steps` decode steps over the paged
    cache. Returns the tokens (prefill's first), each step's logits, and the sequence's KV after the last step."""
    spec = runner.spec
    logits, kv = forward.prefill(runner, prompt)
    cache = PagedKVCache(spec.num_layers, -(-(len(prompt) + steps) // BLOCK_SIZE), spec.num_kv_heads,
                         spec.head_dim, runner.dtype, runner.device)
    table = cache.allocate(len(prompt) + steps)
    cache.load(table, pieces_of(kv), len(prompt))
    tokens, step_logits = [int(logits.argmax())], []
    for _ in range(steps):
        step_logits.append(forward.decode_step(runner, cache, tokens[-1:], [table], [len(prompt) + len(tokens) - 1])[0])
        tokens.append(int(step_logits[-1].argmax()))
    return tokens, step_logits, cache.read(table, len(prompt) + steps)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("attention_mode", ["auto", "torch"])
def test_decoded_tokens_run_again_get_the_decode_steps_bits(
    head64_model_dir: Path, dtype: str, attention_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A migrated stream's sent tokens are computed again on the next worker. Replayed (forward.replay_pass),
    each row gets the bits of the decode step that first read it: the logits that pick the next token and every
    layer's KV, whole or in chunks, after a prompt prefilled whole or in chunks; with the C++ decode kernels and
    with their torch references (PDSERVE_ATTENTION=torch). Prefill's arithmetic (its own attention kernel)
    would round them differently."""
    monkeypatch.setenv("PDSERVE_ATTENTION", attention_mode)
    runner = ModelConfig(model=str(head64_model_dir), dtype=dtype, runner="fast").load()
    assert runner.fast is not None and runner.fast.replays
    prompt = [(j * 31) % 49000 + 10 for j in range(45)]
    steps = 12
    tokens, step_logits, kv = _decoded(runner, prompt, steps)
    for prompt_cut, replay_cuts in ((45, (12,)), (20, (5, 12)), (45, (1, 2, 11, 12))):
        cache = WatchedCache()
        forward.prefill_pass(runner, [prompt[:prompt_cut]], cache)
        if prompt_cut < len(prompt):
            forward.prefill_pass(runner, [prompt[prompt_cut:]], cache)
        done = 0
        for cut in replay_cuts:
            logits = forward.replay_pass(runner, tokens[done:cut], cache)
            assert torch.equal(logits, step_logits[cut - 1]), (prompt_cut, cut)
            done = cut
        for (keys, values), (want_keys, want_values) in zip(forward.cached_layers(cache), kv):
            assert torch.equal(keys, want_keys) and torch.equal(values, want_values)


@pytest.mark.parametrize("prompt_len", [37, 32])  # 32: on the hit, the whole prompt is cached and only replays run
def test_a_job_with_decoded_tokens_gets_the_decode_steps_token_and_kv_and_caches_only_its_prompt(
    head64_model_dir: Path, prompt_len: int,
) -> None:
    """The engine runs a migrated stream's prompt as prompt and its decoded tokens as replayed decode steps, in
    passes of their own (chunks never span the two). Its first token and delivered KV are an uninterrupted run's,
    bfloat16, bit for bit, computed into memory of its own or into a home (decode's shared-memory segment); the
    prefix cache keeps only its prompt's blocks, so a later prompt that holds the same tokens still gets prefill's
    bits, hit or miss."""
    runner = ModelConfig(model=str(head64_model_dir), dtype="bfloat16", runner="fast").load()
    prompt = [(j * 17) % 49000 + 10 for j in range(prompt_len)]
    steps = 26
    tokens, _, kv = _decoded(runner, prompt, steps)
    prefix_cache = PrefixCache(block_tokens=16, budget_bytes=64 << 20)
    engine = EngineCore(runner, chunk_tokens=10, prefix_cache=prefix_cache)
    engine.start()
    try:
        for attempt in range(2):  # a miss, then a hit on the prompt's two full blocks, into a home
            recorder = Recorder(prompt + tokens[:steps])
            recorder.job.decoded = steps
            if attempt:
                recorder.job.kv_home = [(torch.full_like(k, torch.nan), torch.full_like(v, torch.nan)) for k, v in kv]
            engine.submit(recorder.job)
            outcome = recorder.wait()
            assert isinstance(outcome, Prefilled), outcome
            assert outcome.cached_tokens == 32 * attempt
            # prompt passes of at most 10 tokens, never holding a decoded one, then 26 decoded tokens in 3
            assert outcome.passes == -(-(prompt_len - 32 * attempt) // 10) + 3
            assert outcome.first_token == tokens[steps]
            for layer, (keys, values) in enumerate(kv):
                assert torch.equal(recorder.layers[layer][0], keys) and torch.equal(recorder.layers[layer][1], values)
                if recorder.job.kv_home is not None:
                    home_keys, home_values = recorder.job.kv_home[layer]
                    assert torch.equal(home_keys, keys) and torch.equal(home_values, values)
        assert len(prefix_cache.match(prompt + tokens)) == 2  # 32 of the prompt's 37 tokens; none decoded
    finally:
        engine.close()


def test_reference_runner_is_token_identical_to_hugging_face(tiny_model_dir: Path) -> None:
    runner = ModelConfig(model=str(tiny_model_dir), dtype="float32", runner="hf").load()
    assert runner.fast is None and runner.model is not None
    prompts = [[5, 6, 7, 8, 9], list(range(100, 140))]
    for prompt, (tokens, _) in zip(prompts, greedy(runner, prompts, 12)):
        assert tokens == hf_reference(tiny_model_dir, prompt, 12)[0]


def test_runner_choice(tiny_model_dir: Path, tmp_path: Path) -> None:
    assert ModelConfig(model=str(tiny_model_dir)).load().runner_name == "fast"  # auto picks fast for Llama
    with pytest.raises(ValueError, match="--runner"):
        ModelConfig(model=str(tiny_model_dir), runner="turbo")
    other = tmp_path / "gpt2"
    other.mkdir()
    (other / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_model(other, runner="fast")


def test_a_device_that_is_not_here_is_refused_by_name(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="expected cpu or cuda"):
        ModelConfig(model=str(tiny_model_dir), device="tpu")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"this machine has \d+ CUDA device"):
            load_model(tiny_model_dir, device=f"cuda:{torch.cuda.device_count()}")
    else:
        with pytest.raises(ValueError, match="CUDA is not available"):
            load_model(tiny_model_dir, device="cuda")


def test_paged_cache_hands_out_and_takes_back_blocks() -> None:
    cache = PagedKVCache(num_layers=2, num_blocks=5, num_kv_heads=2, head_dim=4, dtype=torch.float32,
                         device=torch.device("cpu"))
    first = cache.allocate(2 * BLOCK_SIZE + 1)  # 3 blocks
    assert len(first) == 3 and cache.free_blocks == 2
    with pytest.raises(OutOfBlocks, match="need 3 KV blocks; 2 of 5 free"):
        cache.allocate(3 * BLOCK_SIZE)
    second = cache.allocate(BLOCK_SIZE)
    kv = [(torch.randn(2, 20, 4), torch.randn(2, 20, 4)) for _ in range(2)]
    cache.load(first, pieces_of(kv), 20)
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(cache.read(first, 20), kv))
    assert not cache.kv[:, :, second].any()
    cache.free(first)
    cache.free(second)
    assert cache.free_blocks == 5
    assert sorted(cache.allocate(5 * BLOCK_SIZE)) == list(range(5))


def test_warm_up_loads_every_cpu_kernel_a_request_uses(head64_model_dir: Path) -> None:
    """A kernel first loaded (or built) at a worker's first request stalls it: a decode replica building the greedy
    kernel at its first step stalled 7.6 s, long enough for the gateway to move a stream away. A fresh process, as
    a worker starts: after `warm_up`, every CPU kernel is loaded."""
    code = ("import sys\n"
            "from model_runner import attention, forward, gemm, prefill_attention, sampling\n"
            "from model_runner.loading import ModelConfig\n"
            "runner = ModelConfig(model=sys.argv[1], dtype='bfloat16', runner='fast').load()\n"
            "kernels = (gemm, prefill_attention, attention, sampling)\n"
            "print([m.KERNEL._state for m in kernels])\n"
            "forward.warm_up(runner)\n"
            "print([m.KERNEL._state for m in kernels])\n")
    done = subprocess.run([sys.executable, "-c", code, str(head64_model_dir)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    before, after = done.stdout.strip().splitlines()[-2:]
    assert "None" in before  # some load only on first use: the test would not see them otherwise
    assert after == "[True, True, True, True]"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_s_kv_lands_in_its_blocks_the_same_by_the_c_copy_as_by_torch(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU pool takes a joining prompt's KV with `store_prompt` (C++, block by block); PDSERVE_ATTENTION=torch
    copies with index_copy_. Same bits, nothing outside the prompt's positions written: a partial last block,
    pieces in chunks, and a wire dtype that differs from the pool's."""
    length, heads, dim, layers = 37, 3, 8, 2  # 2 whole blocks and 5 tokens
    generator = torch.Generator().manual_seed(0)
    kv = [(torch.randn(heads, length, dim, generator=generator), torch.randn(heads, length, dim, generator=generator))
          for _ in range(layers)]
    chunked = [[(start, t.reshape(-1)[start : start + 100]) for start in range(0, t.numel(), 100)] for t in
               [tensor for pair in kv for tensor in pair]]
    pools, copied_by_c = {}, []
    store_prompt = attention.store_prompt
    monkeypatch.setattr(attention, "store_prompt", lambda *args: copied_by_c.append(store_prompt(*args)) or
                        copied_by_c[-1])
    for mode in ("auto", "torch"):
        monkeypatch.setenv("PDSERVE_ATTENTION", mode)
        cache = PagedKVCache(layers, 8, heads, dim, dtype, torch.device("cpu"))
        cache.kv.fill_(7)  # a sentinel where nothing may be written
        blocks = [5, 1, 6]
        cache.load(blocks, chunked, length)
        pools[mode] = cache.kv.clone()
        for (k2, v2), (k, v) in zip(cache.read(blocks, length), kv):
            assert torch.equal(k2, k.to(dtype)) and torch.equal(v2, v.to(dtype))
        written = torch.zeros_like(cache.kv, dtype=torch.bool)
        for position in range(length):
            written[:, :, blocks[position // BLOCK_SIZE], position % BLOCK_SIZE] = True
        assert (cache.kv[~written] == 7).all()
    assert torch.equal(pools["auto"], pools["torch"])
    assert copied_by_c == [True, False]  # the C++ copy, then torch's


def test_default_dtype_gives_the_same_tokens_disaggregated_colocated_and_alone(tiny_model_dir: Path) -> None:
    """bfloat16, the default: concurrent requests through a disaggregated cluster and a colocated one get the
    tokens the runner gives each prompt alone in this process, greedy; seeded sampling agrees between the two."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = ["The capital of France is", "Write a short poem about the sea and the wind.",
               "def fibonacci(n):\n    " * 6, "Once upon a time"]
    runner = ModelConfig(model=str(tiny_model_dir), dtype="bfloat16").load()
    expected = [greedy(runner, [tokenizer(p).input_ids], 12)[0][0] for p in prompts]
    clusters = [start_cluster(tiny_model_dir, dtype="bfloat16"),
                start_cluster(tiny_model_dir, prefill=0, dtype="bfloat16")]
    try:
        seeded = []
        for cluster in clusters:
            with ThreadPoolExecutor(len(prompts)) as pool:
                completions = list(pool.map(lambda p, c=cluster: generate(
                    c.gateway.address, timeout=60, prompt=p, max_tokens=12, temperature=0.0, ignore_eos=True),
                    prompts))
            assert [c.token_ids for c in completions] == expected
            seeded.append(generate(cluster.gateway.address, timeout=60, prompt=prompts[1], max_tokens=12,
                                   temperature=0.9, seed=7, ignore_eos=True).token_ids)
            assert_nothing_held(cluster)
        assert seeded[0] == seeded[1]
    finally:
        for cluster in clusters:
            cluster.stop()
