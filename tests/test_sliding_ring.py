"""Sliding-window layers in per-slot rings (model/state.py, --sliding-kv window): a ring of R
pages per slot, logical page b at ring page b % R, read by the unchanged paged kernels.

Against the whole-context layout on fresh random inputs: the Triton kernels (under
TRITON_INTERPRET=1 on a CPU machine) and the torch references over a ring written piece by
piece equal the references over every page; a GPT-OSS model decoding past the window from a
ring state, its prompt given in one call longer than the ring holds (split by the attention
layer), equals the same model on a full state; a window read out of one slot's ring and
written into another's continues identically (what a prefix-cache checkpoint does); and the
memory the plan counts for the rings is what the state allocates.
"""
import pytest
import torch

import hf_models
from freetoken.config import ModelConfig
from freetoken.kernels.paged_attention import (paged_decode_attention_torch, paged_decode_attention_triton,
                                               paged_prefill_attention_torch, paged_prefill_attention_triton,
                                               write_kv)
from freetoken.model.state import (DecodeState, checkpoint_state_bytes, kv_page_bytes, ring_layers, ring_pages,
                                   slot_state_bytes, state_bytes)
from freetoken.runtime.budget import plan_memory
from freetoken.runtime.engine import Engine, EngineConfig
from freetoken.weights.convert import convert
from test_reference import rel_err


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels' device (the interpreter on a CPU machine)


def rel(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.mark.parametrize("window,page,chunk", [(8, 4, 6), (13, 16, 16), (5, 4, 2)])
def test_kernels_over_a_ring_equal_the_whole_context(window, page, chunk):
    """A sequence written chunk by chunk into a ring (pieces of `chunk` tokens, the ring sized
    for them) and into a whole-context layout: after each piece, prefill attention of the piece
    and decode attention at its end agree, Triton over the ring against torch over every page."""
    g = torch.Generator().manual_seed(window * 100 + page + chunk)
    kvh, nh, hd, n = 2, 4, 16, 45
    r = -(-(chunk + window - 1) // page) + 1  # as model/state.py ring_pages sizes it
    width = -(-n // page)
    ring_row = (1 + torch.arange(width, device=DEV) % r).to(torch.int32)  # [W] slot 0's ring: pages 1..r
    full_row = (torch.randperm(width, generator=g) + 1).to(DEV, torch.int32)  # [W] the whole context, shuffled
    kr, vr = (torch.zeros(1 + r, kvh, page, hd, device=DEV) for _ in range(2))
    kf, vf = (torch.zeros(1 + width, kvh, page, hd, device=DEV) for _ in range(2))
    scale = hd ** -0.5
    for start in range(0, n, chunk):
        t = min(chunk, n - start)
        pos = torch.arange(start, start + t, device=DEV)
        k, v = (torch.randn(t, kvh, hd, generator=g).to(DEV) for _ in range(2))
        write_kv(kr, vr, k, v, ring_row[pos // page].long(), pos % page)
        write_kv(kf, vf, k, v, full_row[pos // page].long(), pos % page)
        q = torch.randn(t, nh, hd, generator=g).to(DEV)
        want = paged_prefill_attention_torch(q, kf, vf, full_row, start, scale, window)
        assert rel(paged_prefill_attention_torch(q, kr, vr, ring_row, start, scale, window), want) < 1e-5
        assert rel(paged_prefill_attention_triton(q, kr, vr, ring_row, start, scale, window), want) < 1e-5
        qd = torch.randn(1, nh, hd, generator=g).to(DEV)
        lens = torch.tensor([start + t], dtype=torch.int32, device=DEV)
        want = paged_decode_attention_torch(qd, kf, vf, full_row[None], lens, scale, window)
        assert rel(paged_decode_attention_torch(qd, kr, vr, ring_row[None], lens, scale, window), want) < 1e-5
        assert rel(paged_decode_attention_triton(qd, kr, vr, ring_row[None], lens, scale, window, splits=3,
                                                 block_n=16, min_split_keys=16), want) < 1e-5


def check_ring_against_full(model, m, ring, full, prompt, steps: int, idle_token: int):
    """The prompt in one call into slot 1 of each state (slot 0's ring pages stay someone
    else's), then `steps` greedy decode steps beside an idle row 0: the same tokens, logits
    within 1e-5 of each other and 1e-4 of transformers'."""
    n, outs = len(prompt), {}
    for name, st in (("ring", ring), ("full", full)):
        st.reserve(1, 128)
        logits = [m.prefill(prompt, st, 1, 0, all_logits=True)]
        tok, toks = int(logits[0][-1].argmax()), []
        for i in range(steps):
            toks.append(tok)
            out = m.decode(torch.tensor([idle_token, tok]), st, torch.tensor([0, n + i]),
                           torch.tensor([False, True]))[1]
            logits.append(out[None])
            tok = int(out.argmax())
        outs[name] = (torch.cat(logits), toks)
    assert outs["ring"][1] == outs["full"][1]
    assert rel_err(outs["ring"][0], outs["full"][0]) < 1e-5
    ref = hf_models.reference_logits(model, prompt.tolist() + outs["full"][1])
    assert rel_err(outs["ring"][0], ref) < 1e-4


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory):
    d = tmp_path_factory.mktemp("ring")
    model = hf_models.gpt_oss(11, sliding_window=6, layer_types=["sliding_attention", "full_attention",
                                                                 "sliding_attention"], num_hidden_layers=3)
    hf_models.save(model, str(d / "hf"))
    convert(str(d / "hf"), str(d / "m.ftw"), progress=False)
    return model, Engine(str(d / "m.ftw"), EngineConfig(device="cpu", dtype="float32"))


def test_model_on_rings_equals_the_whole_context(gptoss):
    """A 40-token prompt in one call into rings sized for 4-token pieces (the layer splits it),
    then 24 decode steps past the window: the logits of the full state, and transformers'."""
    model, eng = gptoss
    cfg, m = eng.cfg, eng.model
    ring = DecodeState(cfg, 2, 128, eng.device, eng.dtype, page_size=4, chunk=4)
    full = DecodeState(cfg, 2, 128, eng.device, eng.dtype, page_size=4, sliding="full")
    assert ring.ring == [0, 2] and full.ring == [] and 4 <= ring.ring_chunk < 40
    assert ring.k[0].shape[0] == 1 + 2 * ring_pages(cfg, 4, 4) == 1 + 2 * 4 and ring.k[1].shape[0] == full.k[0].shape[0]
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 320, (40,), generator=g)
    check_ring_against_full(model, m, ring, full, prompt, steps=24, idle_token=0)


@pytest.mark.parametrize("p", [3, 23])
def test_window_moves_between_slots(gptoss, p):
    """read_window at p out of slot 0, write_window into slot 1 (with the full layer's pages
    shared): slot 1 decodes from p exactly as slot 0 does; p = 3: fewer tokens than the window."""
    _, eng = gptoss
    m = eng.model
    st = DecodeState(eng.cfg, 2, 64, eng.device, eng.dtype, page_size=4, chunk=8)
    pages = st.reserve(0, 64)
    g = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, 320, (p,), generator=g)
    m.prefill(prompt, st, 0, 0)
    st.set_pages(1, pages)  # the pool layer: the same pages (what a restore shares in place)
    for layer in st.ring:
        k, v = st.read_window(layer, 0, p)
        assert k.shape == (5, *st.k[layer].shape[1:2], st.k[layer].shape[3])
        st.write_window(layer, 1, p, [k.clone(), v.clone()])
    x = torch.tensor([7, 7])
    out = m.decode(x, st, torch.tensor([p, p]), torch.tensor([True, False]))[0]
    other = m.decode(x, st, torch.tensor([p, p]), torch.tensor([False, True]))[1]
    assert torch.equal(out, other)


@pytest.mark.parametrize("which", ["gptoss", "v4"])
def test_checkpoints_inside_split_pieces(gptoss, v4, which):
    """A prompt in one call, split into ring pieces, with prefix-cache checkpoints inside them
    (3: before the window has filled): each checkpoint holds the ring rows a prefill of exactly
    that many tokens leaves."""
    from freetoken.cache.anchors import CheckpointPolicy
    from freetoken.cache.prefix import PrefixCache
    _, eng = gptoss if which == "gptoss" else v4
    st = DecodeState(eng.cfg, 2, 64, eng.device, eng.dtype, page_size=4, chunk=4)
    cache = PrefixCache(eng.cfg, st, 8, CheckpointPolicy("none", set()))
    prompt = torch.randint(0, 320, (30,), generator=torch.Generator().manual_seed(12))
    cuts = [3, 10, 14, 29]
    assert st.ring_chunk < 30 and cache.hybrid
    st.reserve(0, 64)
    eng.model.prefill(prompt, st, 0, 0, capture=cache.capture(prompt.tolist(), cuts))
    for p in cuts:
        ref = DecodeState(eng.cfg, 1, 64, eng.device, eng.dtype, page_size=4, chunk=4)
        ref.reserve(0, 64)
        eng.model.prefill(prompt[:p], ref, 0, 0)
        at, slot = cache.ckpt.lookup(prompt.tolist(), p)
        assert at == p
        for layer in st.ring:
            for got, want in zip(cache.win[layer], ref.read_window(layer, 0, p)):
                err = float((got[slot] - want).abs().max() / want.abs().max())
                assert err < 1e-5, (p, layer, err)


def test_memory_counted_as_allocated(gptoss):
    """state_bytes is what a DecodeState allocates, rings or not; the rings leave the pool."""
    _, eng = gptoss
    cfg = eng.cfg
    for sliding in ("window", "full"):
        st = DecodeState(cfg, 3, 256, eng.device, eng.dtype, page_size=4, chunk=8, sliding=sliding)
        assert st.nbytes() == state_bytes(cfg, 3, 256, eng.dtype, page_size=4, chunk=8, sliding=sliding)
        assert bool(st.ring) == (sliding == "window")
    assert ring_layers(cfg, 16, 4, 8) == []  # a context shorter than a ring: the pool


def test_plan_for_gpt_oss_120b_shape():
    """The published gpt-oss-120b shape (36 layers alternating, 8 KV heads of 64, window 128), a
    131k context: the pool's pages carry the 18 full layers only, the rings cost each slot 137
    pages of the window layers, a checkpoint 127 positions of them."""
    cfg = ModelConfig.from_hf({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088,
                               "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36,
                               "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
                               "num_local_experts": 128, "num_experts_per_tok": 4, "sliding_window": 128,
                               "max_position_embeddings": 131072})
    bf16 = torch.bfloat16
    ring = ring_layers(cfg, 131072, 16, 2048)
    assert len(ring) == 18
    token = 8 * 64 * 2 * 2  # K and V of one layer, bf16
    assert kv_page_bytes(cfg, 16, bf16, ring) == 16 * 18 * token == kv_page_bytes(cfg, 16, bf16) // 2
    assert slot_state_bytes(cfg, bf16, ring, 16, 2048) == 137 * 16 * 18 * token
    assert checkpoint_state_bytes(cfg, bf16, ring) == 127 * 18 * token
    args = dict(cfg=cfg, device=torch.device("cpu"), dtype=bf16, budget=200 << 30, weights=0, slots=4,
                max_len=131072, chunk=2048, page_size=16, checkpoint_slots=8)
    window, full = plan_memory(**args), plan_memory(**args, sliding="full")
    assert window.kv_pages == full.kv_pages == 4 * 8192 + 1  # every slot's whole context fits either way
    assert window.kv + window.state < 0.52 * (full.kv + full.state)


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    """DeepSeek-V4: a sliding-only, two CSA (windows of 4, indexer top-3) and an HCA layer (windows
    of 8), a window of 8 keys; reach max(8, 2 * 4, 8) = 8."""
    from unittest import mock
    d = tmp_path_factory.mktemp("ring-v4")
    model = hf_models.deepseek_v4(3)
    hf_models.save(model, str(d / "hf"))
    convert(str(d / "hf"), str(d / "m.ftw"), progress=False)
    with mock.patch("freetoken.experts.cpu.extension", lambda: None):  # the torch expert path: quick to load
        eng = Engine(str(d / "m.ftw"), EngineConfig(device="cpu", dtype="float32"))
    return model, eng


def test_v4_on_rings_equals_the_whole_context(v4):
    """DeepSeek-V4 with its keys and compressor projections in rings sized for 4-token pieces and
    its entries in the pool: a 45-token prompt in one call (past the window, the windows of 4 and
    8 and the indexer's top-3), then 20 decode steps beside an idle row: the full state's logits
    and transformers'."""
    model, eng = v4
    cfg, m = eng.cfg, eng.model
    ring = DecodeState(cfg, 2, 128, eng.device, eng.dtype, page_size=4, chunk=4)
    full = DecodeState(cfg, 2, 128, eng.device, eng.dtype, page_size=4, sliding="full")
    assert ring.ring == cfg.attention_layers and set(ring.kr) == set(ring.ring) and not full.kr
    assert ring.reach == 8 and ring.ring_chunk < 45
    assert ring.k[0].shape[-1] == 0 and ring.kr[0].shape[-1] == cfg.head_dim  # sliding-only: nothing pooled
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, 320, (45,), generator=g)
    check_ring_against_full(model, m, ring, full, prompt, steps=20, idle_token=5)


def test_v4_per_token_cache_of_the_published_shape():
    """DeepSeek-V4-Flash's attention shape (head_dim 512, indexer 128, window 128, CSA windows of
    4, HCA of 128; the published config's first six layers: two sliding-only, then CSA and HCA in
    turn): what one token costs the pool with rings (the entries) against every part per token."""
    from test_deepseek_v4 import published_config
    cfg = ModelConfig.from_hf(published_config())
    bf16 = torch.bfloat16
    ring = ring_layers(cfg, 1 << 20, 16, 2048)
    assert ring == list(range(6))
    csa, hca = 512 + 128, 512  # entries pooled: the attention's, and the indexer's (CSA)
    assert kv_page_bytes(cfg, 1, bf16, ring) == 2 * (2 * csa + 2 * hca)
    every = 2 * 512 + 2 * (512 + 4 * 512 + 512 + 4 * 128 + 128) + 2 * (512 + 2 * 512 + 512)
    assert kv_page_bytes(cfg, 1, bf16) == 2 * every
    assert kv_page_bytes(cfg, 1, bf16) > 5 * kv_page_bytes(cfg, 1, bf16, ring)
    # pages of 16: a row per window closing in the page (CSA 16 / 4 = 4 rows, HCA one): 32x less
    assert kv_page_bytes(cfg, 16, bf16, ring) == 2 * (2 * 4 * csa + 2 * 1 * hca)
    assert kv_page_bytes(cfg, 16, bf16) == 16 * 2 * every > 32 * kv_page_bytes(cfg, 16, bf16, ring)
    # the rings hold the reach (128) plus a chunk per slot; a checkpoint each part's own reach
    # before the next token: the sliding key 127 positions, CSA's projections 7 (2m - 1), HCA's 127
    per_token_ring = 2 * (2 * 512 + 2 * (512 + 4 * 512 + 4 * 128) + 2 * (512 + 2 * 512))
    assert slot_state_bytes(cfg, bf16, ring, 16, 2048) == ring_pages(cfg, 16, 2048) * 16 * per_token_ring
    ckpt = 2 * (6 * 127 * 512 + 2 * 7 * (4 * 512 + 4 * 128) + 2 * 127 * 2 * 512)
    assert checkpoint_state_bytes(cfg, bf16, ring) == ckpt < 127 * per_token_ring * 0.6
