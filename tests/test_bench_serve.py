"""bench/serve.py: every request's prompt is unique from its first content token, so the only
prefix two requests share is the chat template's fixed opening."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root: bench/
from bench.serve import chat_tokens, pct, prompts, shared_prefixes  # noqa: E402
from freetoken.demo import demo_path  # noqa: E402


def test_prompts_share_only_the_template_opening():
    tok, encode = chat_tokens(demo_path())
    texts = prompts(tok, 1 + 1 + 2 + 4 + 8, 200, seed=0)
    ids = [encode([{"role": "user", "content": t}]) for t in texts]
    opening, longest = shared_prefixes(ids)
    assert longest == opening and tok.decode(ids[0][:opening]) == "<|im_start|>user\n"
    assert len({i[opening] for i in ids}) == len(ids)  # the first content token differs in every prompt
    assert prompts(tok, 16, 200, seed=0) == texts and prompts(tok, 16, 200, seed=1) != texts
    assert shared_prefixes([[1, 2, 3], [1, 2, 4], [1, 5]]) == (1, 2)


def test_nearest_rank_percentile():
    xs = [float(i) for i in range(1, 101)]
    assert pct(xs, 50) == 50 and pct(xs, 99) == 99 and pct([3.0], 99) == 3.0 and pct([], 50) is None
