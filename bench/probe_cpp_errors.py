"""The C++ executor's error paths, each in its own process (a crash ends only that case). On
the GPU machine (torch 2.11, Python 3.12; 2026-12-02, commit 028debf) every error whose message
the extension built crashed the process (rc -11): a multi-argument TORCH_CHECK (c10::str formats
through an ostringstream in the extension) and a std::runtime_error thrown with a concatenated
std::string; a literal-message TORCH_CHECK (forward_bad_id) raised. Since then every check in
moe_cpu.cpp raises a literal message; this probe shows whether that holds there.
Usage, from the repo root: python3 -m bench.probe_cpp_errors [case | case,case,...]"""
import subprocess, sys
CASES = ["qbanks_bad_scale", "forward_bad_id", "forward_bad_scale", "forward_bad_scale_clone", "fp8_bad_scale", "bad_act", "bad_bias", "forward_ok"]
if len(sys.argv) == 1 or "," in sys.argv[1]:  # all cases, or a comma-separated few
    for c in (CASES if len(sys.argv) == 1 else sys.argv[1].split(",")):
        r = subprocess.run([sys.executable, "-X", "faulthandler", "-m", "bench.probe_cpp_errors", c], capture_output=True, text=True, timeout=300)
        print(f"--- {c}: rc {r.returncode}\n{r.stdout[-800:]}{r.stderr[-1500:]}", flush=True)
    sys.exit(0)
import torch
sys.path.insert(0, "tests")
from test_cpu_quantized import random_banks
from freetoken.experts.cpu import CpuExpertExecutor, extension
c = sys.argv[1]
fmt = "fp8_block" if c.startswith("fp8") else "mxfp4"
b = random_banks(fmt, None, 4, 256 if fmt == "fp8_block" else 64, 128 if fmt == "fp8_block" else 32, seed=12)
ex = CpuExpertExecutor(b)
args = list(ex._qargs)
print("made executor", fmt, [tuple(a.shape) if hasattr(a, "shape") else a for a in args], flush=True)
x, ids, w = torch.randn(1, args[4].shape[1]), torch.tensor([[0]]), torch.ones(1, 1)
if c in ("forward_bad_scale", "fp8_bad_scale", "qbanks_bad_scale"):
    args[5] = args[5][..., :0]
elif c == "forward_bad_scale_clone":
    args[5] = args[5][..., :0].clone()
elif c == "forward_bad_id":
    ids = torch.tensor([[9]])
fn = dict(ex._fn)
if c == "bad_act":
    fn["act"] = 99
elif c == "bad_bias":
    fn["gate_up_bias"] = torch.zeros(3, 5)
try:
    if c == "qbanks_bad_scale":
        extension().qbanks_create(*args)
    else:
        extension().forward_q(ex.handle, x, ids, w, *args, False, **fn)
    print("returned", flush=True)
except Exception as e:
    print("raised", type(e).__name__, str(e)[:200], flush=True)
