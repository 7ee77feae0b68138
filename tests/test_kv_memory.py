"""KV pages are taken as tokens arrive, from one pool: a server sized for 8 requests at the
model's full context commits memory only for the tokens it holds, and a reused prefix is
shared in place (no new pages for it)."""
import hf_models
from freetoken.cache.config import CacheConfig
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.runtime.request import Request, SamplingOptions
from freetoken.runtime.serving import ServingEngine
from freetoken.weights.convert import convert


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def run(srv, prompt, n=4):
    req = Request(list(prompt), SamplingOptions(temperature=0, max_tokens=n, ignore_eos=True))
    srv.sched.add(req)
    while req.finished_at is None:
        srv.step()
    return req


def test_pages_follow_tokens_and_prefixes_are_shared(tmp_path):
    # attention-heavy, long context: a full-context reservation would be visible at once
    model = hf_models.qwen3_5(5, num_hidden_layers=4, max_position_embeddings=65536, num_key_value_heads=4,
                              head_dim=64, layer_types=["full_attention"] * 4)
    hf_models.save(model, str(tmp_path / "hf"))
    convert(str(tmp_path / "hf"), str(tmp_path / "m.ftw"), progress=False)
    eng = Engine(str(tmp_path / "m.ftw"), EngineConfig(device="cpu", dtype="float32"))
    before = rss()
    srv = ServingEngine(eng, max_batch=8, start=False, cache=CacheConfig(page_size=16))
    pool = srv.state.pages
    full = sum(t.numel() * t.element_size() for t in (*srv.state.k.values(), *srv.state.v.values()))
    assert full > 1 << 30 and pool.num_pages >= 8 * (65536 // 16)  # every slot's full context...
    assert rss() - before < full // 10  # ...is address space, not memory, until tokens arrive
    assert pool.used == 0
    prompt = list(range(10, 10 + 300))
    first = run(srv, prompt)
    held = pool.used  # now the prefix cache's: the prompt and all outputs but the last
    assert held == -(-(300 + 3) // 16) and first.cached_tokens == 0
    second = Request(prompt + [7, 8, 9], SamplingOptions(temperature=0, max_tokens=3, ignore_eos=True))
    srv.sched.add(second)
    srv.step()  # restored and prefilled, one token out
    assert second.cached_tokens == 300 and second.shared_pages == 300 // 16
    # its own pages: the copy-on-write page at position 300 and what follows; nothing for the prefix
    assert pool.used - held == len(second.pages) - second.shared_pages == -(-(300 + 3 + 1) // 16) - 300 // 16
    while second.finished_at is None:
        srv.step()
