"""Where an engine prefill with flash-linear-attention departs from the torch chunk rule (GPU).

tests/test_deltanet_chunks.py's engine test found bf16 prefill logits 35% apart with fla on and
off (H200, ec9d29b) while the kernel-level test (random heads) agreed within 0.7%. This runs the
same small model (DeltaNet heads 128 wide) and reports, per DeltaNet call, the kernel's output
and final state against our rule on the very tensors the engine passed; and the engine's logits
with fla on and off against transformers in fp32 and in bf16 (the bf16 noise floor).

    python3 -m bench.fla_engine_diag [--name fla_engine_diag]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

from bench.common import write_result


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", default="fla_engine_diag")
    ap.add_argument("--tokens", type=int, default=600)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (fla is CUDA-only)")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    import conftest  # noqa: F401  (imports transformers' reference models with fla hidden)
    import hf_models
    from freetoken.kernels import fla_delta
    from freetoken.model.deltanet import chunk_gated_delta_rule, l2norm
    from freetoken.runtime.engine import Engine, EngineConfig
    from freetoken.weights.convert import convert

    calls = []
    real = fla_delta.chunk_delta_fla

    def spy(q, k, v, g, beta, state, scale, cuts=()):
        s0 = state.clone()
        out, new, snaps = real(q, k, v, g, beta, state, scale, cuts)
        rep = v.shape[1] // q.shape[1]
        qf = l2norm(q.float().repeat_interleave(rep, dim=1)) * scale
        kf = l2norm(k.float().repeat_interleave(rep, dim=1))
        ref, ref_new, _ = chunk_gated_delta_rule(qf, kf, v.float(), g, beta, s0.clone(), cuts=cuts)
        calls.append({"t": q.shape[0], "out_rel": round(_rel(out, ref), 5), "state_rel": round(_rel(new, ref_new), 5),
                      "state_in_absmax": round(float(s0.abs().max()), 4), "g_min": round(float(g.min()), 3),
                      "beta_range": [round(float(beta.min()), 3), round(float(beta.max()), 3)],
                      "strides": [list(q.stride()), list(v.stride())], "state_changed_in_place": bool(
                          (state - s0).abs().max() > 0)})
        return out, new, snaps

    fla_delta.chunk_delta_fla = spy
    res = {"calls_fla_on": None, "logits": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model = hf_models.qwen3_5(5, num_hidden_layers=4, max_position_embeddings=1024, linear_key_head_dim=128,
                                  linear_value_head_dim=128)
        hf_models.save(model, os.path.join(tmp, "hf"))
        convert(os.path.join(tmp, "hf"), os.path.join(tmp, "m.ftw"), progress=False)
        prompt = torch.randint(0, 320, (args.tokens,), generator=torch.Generator().manual_seed(3)).tolist()
        with torch.no_grad():
            ref32 = hf_models.reference_logits(model, prompt)  # [T, V] fp32
            import copy
            ref16 = hf_models.reference_logits(copy.deepcopy(model).to(torch.bfloat16), prompt)
        res["logits"]["hf_bf16_vs_fp32"] = round(_rel(ref16, ref32), 5)
        for chunk in (256, 4096):
            eng = Engine(os.path.join(tmp, "m.ftw"), EngineConfig(device=args.device, dtype="bfloat16", experts="gpu" if args.device == "cuda" else "cpu",
                                                                  prefill_chunk=chunk))
            for flag in ("1", "0"):
                os.environ["FREETOKEN_FLA"] = flag
                calls.clear()
                st = eng.new_state(len(prompt) + 2)
                got = eng.prefill(prompt, st, all_logits=True).float().cpu()  # [T, V]
                key = f"chunk{chunk}_fla{flag}"
                res["logits"][key + "_vs_fp32"] = round(_rel(got, ref32), 5)
                res["logits"][key + "_first64_vs_fp32"] = round(_rel(got[:64], ref32[:64]), 5)
                res["logits"][key + "_per_chunk_vs_fp32"] = [round(_rel(got[s:s + chunk], ref32[s:s + chunk]), 5)
                                                            for s in range(0, len(prompt), chunk)]
                if flag == "1":
                    res[f"calls_chunk{chunk}_fla_on"] = list(calls)
            del eng
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    for k, v in res["logits"].items():
        print(k, v)
    for c in res.get("calls_chunk256_fla_on") or []:
        print(c)
    write_result(args.name, res)


if __name__ == "__main__":
    main()
