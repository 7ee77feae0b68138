"""The fused MLA decode kernels (kernels/mla_decode.py) against their torch references
(model/mla.py latent_prep, latent_q, paged_index_scores, paged_latent_attention) on fresh random
inputs, ragged shapes (dims that are not powers of two, idle rows, lengths mid-page, pages in
random order, NaN in the unwritten rows), then one whole decode layer through either path.

On a CPU machine the kernels run under TRITON_INTERPRET=1 (set in conftest.py before Triton is
imported); on CUDA they run natively.
"""
import pytest
import torch

triton = pytest.importorskip("triton")

from freetoken.kernels import mla_decode as K  # noqa: E402
from freetoken.model import mla  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# the CPU interpreter rounds to bf16 by truncation, one ulp off torch's round-to-nearest
BF16_TOL = 3e-2 if DEV == "cpu" else 2e-2
DTYPES = [torch.float32, torch.bfloat16]


def tol(dtype):
    return 1e-5 if dtype == torch.float32 else BF16_TOL


def rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def rnd(g, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(DEV, dtype)


def paged(g, n, width, ps, dims, dtype, lens=None):
    """A block table [n, width] of distinct pages in random order (page 0: scratch) and a pool
    [pages, 1, ps, dims] of random rows, NaN past each row's length (never written)."""
    pages = 1 + n * width
    table = (1 + torch.randperm(n * width, generator=g)).view(n, width).to(torch.int32)
    pool = torch.randn(pages, 1, ps, dims, generator=g).to(dtype)
    if lens is not None:
        for i, ln in enumerate(lens):
            for j in range(int(ln), width * ps):
                pool[table[i, j // ps], 0, j % ps] = float("nan")
    return table.to(DEV), pool.to(DEV)


def rope_tables(g, max_pos, rd, dtype):
    ang = torch.rand(max_pos, rd // 2, generator=g) * 6.3
    return (torch.cat([ang.cos()] * 2, -1).to(DEV, dtype), torch.cat([ang.sin()] * 2, -1).to(DEV, dtype))


# (ql, kvr, rd, id, full, active): GLM-5-like proportions, small; ragged widths
PREP = [(48, 32, 8, 16, True, False), (40, 24, 6, 20, True, True), (48, 32, 8, 16, False, True),
        (96, 64, 16, 32, True, True)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ql,kvr,rd,idim,full,act", PREP)
def test_prep(ql, kvr, rd, idim, full, act, dtype):
    g = torch.Generator().manual_seed(ql + kvr + rd + idim + full + 2 * act)
    n, ps, width = 3, 4, 5
    a = rnd(g, n, ql + kvr + rd + idim, dtype=dtype, scale=2.0)  # one GEMM output, split into views
    q_lat, kv, ik = a.split([ql, kvr + rd, idim], dim=-1)
    ik = ik if full else None
    pos = torch.tensor([0, 13, 7], device=DEV)
    active = torch.tensor([True, False, True], device=DEV) if act else None
    table, kc = paged(g, n, width, ps, kvr + rd, dtype)
    _, vc = paged(g, n, width, ps, idim, dtype)
    cos, sin = rope_tables(g, 32, rd, dtype)
    qw, kvw = rnd(g, ql, dtype=dtype) + 1, rnd(g, kvr, dtype=dtype) + 1
    ikn = (rnd(g, idim, dtype=dtype) + 1, rnd(g, idim, dtype=dtype)) if full else None
    kc2, vc2 = kc.clone(), vc.clone()
    qn, lens = K.mla_prep_triton(q_lat, kv, ik, pos, active, table, ps, cos, sin, qw, kvw, ikn, 1e-6, 1e-6, kc, vc)
    rqn, rlens = mla.latent_prep(q_lat, kv, ik, pos, active, table, ps, cos, sin, qw, kvw, ikn, 1e-6, 1e-6, kc2, vc2)
    assert qn.dtype == dtype and qn.shape == (n, ql)
    assert lens.tolist() == rlens.tolist()
    assert rel(qn, rqn) < tol(dtype)
    assert torch.equal(kc.isnan(), kc2.isnan()) and torch.equal(vc.isnan(), vc2.isnan())
    assert rel(kc.nan_to_num(), kc2.nan_to_num()) < tol(dtype)
    assert rel(vc.nan_to_num(), vc2.nan_to_num()) < tol(dtype)
    # the rows really were written (and the idle row's went to the scratch page)
    assert not torch.equal(kc, torch.zeros_like(kc)) and rel(kc[table[0, 0], 0, 0], kc2[table[0, 0], 0, 0]) < tol(dtype)


# (n, nh, nope, rd, kvr, ih, id)
QCASES = [(1, 4, 16, 8, 32, 8, 16), (3, 3, 20, 6, 24, 5, 20), (2, 4, 16, 8, 160, 0, 0), (17, 2, 16, 8, 32, 2, 24)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,nh,nope,rd,kvr,ih,idim", QCASES)
def test_q(n, nh, nope, rd, kvr, ih, idim, dtype):
    g = torch.Generator().manual_seed(n * 7 + nh + nope + kvr + ih)
    a = rnd(g, n, nh * (nope + rd) + ih * idim, dtype=dtype)
    q, iq = a.split([nh * (nope + rd), ih * idim], dim=-1)
    iq = iq if ih else None
    vd = 12
    kv_b = rnd(g, nh, nope + vd, kvr, dtype=dtype, scale=kvr ** -0.5)
    w_uk = kv_b[:, :nope]  # a strided view, as the layer keeps it
    pos = torch.randint(0, 40, (n,), generator=g).to(DEV)
    cos, sin = rope_tables(g, 40, rd, dtype)
    out, iout = K.mla_q_triton(q, iq, w_uk, pos, cos, sin, nh, ih)
    rout, riout = mla.latent_q(q, iq, w_uk, pos, cos, sin, nh, ih)
    assert out.shape == rout.shape and out.dtype == dtype
    assert rel(out, rout) < tol(dtype)
    if iq is None:
        assert iout is None
    else:
        assert iout.shape == riout.shape and rel(iout, riout) < tol(dtype)


# (n, ih, id, ps, width, lens)
ICASES = [(1, 8, 16, 4, 20, [37]), (3, 5, 20, 16, 9, [0, 144, 65]), (2, 32, 128, 16, 12, [100, 3])]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,ih,idim,ps,width,lens", ICASES)
def test_index_scores(n, ih, idim, ps, width, lens, dtype):
    g = torch.Generator().manual_seed(n + ih + idim + ps + width)
    table, vc = paged(g, n, width, ps, idim, dtype, lens)
    iq = rnd(g, n, ih, idim, dtype=dtype)
    hw = rnd(g, n, ih)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    for length in (width * ps, (width - 1) * ps):  # the whole table, or fewer pages than it has
        got = K.index_scores_triton(iq, hw, ih ** -0.5, vc, table, lens_t, length, ps, idim ** -0.5)
        ref = mla.paged_index_scores(iq, hw, ih ** -0.5, vc, table, lens_t, length, ps, idim ** -0.5)
        assert got.shape == (n, length) and got.dtype == torch.float32
        assert torch.equal(got.isinf(), ref.isinf())
        fin = ref.isfinite()
        # fp32 scores in both (the keys upcast): tight whatever the dtype
        assert rel(got[fin], ref[fin]) < 1e-5


# (n, nh, kvr, rd, vd, ps, width, lens, k): k = top-k size (None: every position)
ACASES = [(1, 4, 32, 8, 16, 4, 10, [37], 8), (3, 3, 24, 6, 12, 16, 5, [0, 70, 33], 20),
          (2, 4, 32, 8, 16, 4, 10, [9, 40], None), (2, 20, 40, 8, 24, 4, 3, [11, 0], None),
          (1, 16, 512, 64, 48, 16, 20, [300], 64)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,nh,kvr,rd,vd,ps,width,lens,k", ACASES)
def test_attention(n, nh, kvr, rd, vd, ps, width, lens, k, dtype):
    g = torch.Generator().manual_seed(n + nh + kvr + ps + width + (k or 0))
    table, kc = paged(g, n, width, ps, kvr + rd, dtype, lens)
    q = rnd(g, n, nh, kvr + rd, dtype=dtype, scale=0.5)
    kv_b = rnd(g, nh, 16 + vd, kvr, dtype=dtype, scale=kvr ** -0.5)
    w_uv = kv_b[:, 16:]
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    length = width * ps
    top = None
    if k is not None:  # distinct positions, some past the length (as top-k picks among -inf)
        top = torch.stack([torch.randperm(length, generator=g)[:k] for _ in range(n)]).to(DEV)
    scale = (kvr + rd) ** -0.5
    ref = mla.paged_latent_attention(q, kc, table, lens_t, top, length, ps, scale, w_uv)
    for splits in (None, 1, 3):
        got = K.mla_attention_triton(q, kc, table, lens_t, top, length, ps, scale, w_uv, splits=splits)
        assert got.shape == (n, nh * vd) and got.dtype == dtype
        assert torch.isfinite(got).all()
        assert rel(got, ref) < (2e-5 if dtype == torch.float32 else 2 * BF16_TOL), splits
        for i, ln in enumerate(lens):
            if ln == 0:  # an idle row attends to nothing
                assert torch.equal(got[i], torch.zeros_like(got[i]))


# ----------------------------------------------------------------------------- a whole layer


def layer_and_state(dtype, full_then_shared=True, topk=8):
    from freetoken.config import ModelConfig
    from freetoken.model.layers import Rope
    from freetoken.model.state import DecodeState
    nh, nope, rd, vd, kvr, ql, H, ih, idim = 4, 16, 8, 16, 32, 48, 64, 8, 16
    raw = dict(architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", vocab_size=320, hidden_size=H,
               intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=nh,
               num_key_value_heads=nh, n_shared_experts=1, n_routed_experts=16, num_experts_per_tok=4, n_group=1,
               topk_group=1, kv_lora_rank=kvr, q_lora_rank=ql, qk_rope_head_dim=rd, v_head_dim=vd,
               qk_nope_head_dim=nope, index_topk=topk, index_head_dim=idim, index_n_heads=ih,
               first_k_dense_replace=1, max_position_embeddings=256, rope_theta=10000.0, head_dim=rd,
               indexer_types=["full", "shared"])
    cfg = ModelConfig.from_hf(raw)
    g = torch.Generator().manual_seed(5)
    shapes = {"q_a_proj.weight": (ql, H), "kv_a_proj_with_mqa.weight": (kvr + rd, H), "q_a_layernorm.weight": (ql,),
              "kv_a_layernorm.weight": (kvr,), "q_b_proj.weight": (nh * (nope + rd), ql),
              "kv_b_proj.weight": (nh * (nope + vd), kvr), "o_proj.weight": (H, nh * vd),
              "indexer.wq_b.weight": (ih * idim, ql), "indexer.wk.weight": (idim, H),
              "indexer.k_norm.weight": (idim,), "indexer.k_norm.bias": (idim,),
              "indexer.weights_proj.weight": (ih, H)}
    w = {}
    for layer in range(2):
        for name, s in shapes.items():
            t = torch.randn(s, generator=g) * (s[-1] ** -0.5 if len(s) > 1 else 0.1)
            w[f"model.layers.{layer}.self_attn.{name}"] = (t + (1 if "norm.weight" in name else 0)).to(DEV, dtype)
    rope = Rope(rd, 10000.0, 256, DEV, dtype)
    share = {}
    layers = [mla.LatentAttention(cfg, w, i, rope, share) for i in range(2)]
    st = DecodeState(cfg, 2, 128, torch.device(DEV), dtype, page_size=4)
    st.reserve(0, 128)
    st.reserve(1, 128)
    return layers, st, g, H


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("static", [False, True])
def test_decode_layer_fused_equals_torch(monkeypatch, dtype, static):
    """Two rows (one idle) through a full then a shared layer, context past index_topk (the
    indexer decides) and within it (eager: every position), fused kernels against the torch
    decode: the same outputs and the same pages."""
    layers, st, g, H = layer_and_state(dtype)
    for t in (*st.k.values(), *st.v.values()):
        t.normal_(generator=None)
    monkeypatch.setattr(mla, "_capturing", lambda x: static)
    for ctx in (5, 29):
        x = rnd(g, 2, H, dtype=dtype)
        pos = torch.tensor([ctx, 3], device=DEV)
        active = torch.tensor([True, False], device=DEV)
        outs = {}
        for fused in (False, True):
            monkeypatch.setattr(mla, "FUSED", fused)
            k0, v0 = {i: t.clone() for i, t in st.k.items()}, {i: t.clone() for i, t in st.v.items()}
            h = x
            for layer in layers:
                h = layer.decode(h, st, pos, active)
            outs[fused] = (h, {i: t.clone() for i, t in st.k.items()}, {i: t.clone() for i, t in st.v.items()})
            for i in st.k:  # the next run starts from the same pages
                st.k[i].copy_(k0[i])
                st.v[i].copy_(v0[i])
        (a, ka, va), (b, kb, vb) = outs[False], outs[True]
        assert torch.isfinite(b).all()
        assert rel(b[0], a[0]) < (1e-5 if dtype == torch.float32 else 4 * BF16_TOL), ctx
        for i in st.k:
            assert rel(kb[i], ka[i]) < tol(dtype) and rel(vb[i], va[i]) < tol(dtype)
