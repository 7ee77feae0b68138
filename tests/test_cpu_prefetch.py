"""The CPU expert kernels keep their software prefetch in the built extension.

A prefetch has no effect on results, so no numerical test can see it go, and GCC 12 (the dev
machine's and CI's; the GPU host's GCC 13 kept them) dropped them twice: a four-case switch over
the prefetch hint (moe_cpu.cpp prefetch_line) compiled into nothing, so the fp4 and fp8 kernels
built here ran without look-ahead (2-core dev machine, MXFP4 at 2 threads: 11.2 GB/s without,
17.3 with; int8 path 14.6 against 20.2), and its interprocedural passes removed the bf16
kernels' block prefetch (bf16 activations, 2 threads: 25.2 against 28.6 GB/s). This reads the
extension's disassembly instead."""
import re
import shutil
import subprocess

import pytest

from freetoken.experts.cpu import extension

QUANTIZED = re.compile(r"qdot4_(fp4|fp8)_\w+")
# standalone where the compiler keeps them; dot4x2: the dense rows kernel's two-row forms (dense.h)
BF16 = re.compile(r"dot4(x2)?_bf16dp|dot4(x2)?_avx512<unsigned short>")


def disassembly_by_function(path: str) -> dict[str, str]:
    out = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", path], capture_output=True, text=True,
                         check=True).stdout
    funcs, name, body = {}, None, []
    for line in out.splitlines():
        head = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if head:
            if name is not None:
                funcs[name] = "\n".join(body)
            name, body = head.group(1), []
        elif name is not None:
            body.append(line)
    if name is not None:
        funcs[name] = "\n".join(body)
    return funcs


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump to read the extension with")
def test_the_quantized_kernels_prefetch_ahead():
    ext = extension()
    if ext is None:
        pytest.skip("the C++ expert executor is not available here")
    funcs = disassembly_by_function(ext.__file__)
    # the vector kernels (the scalar forms, for CPUs without the ISA and for checking, read plainly)
    # (a kernel's plain name may be a dispatcher to its block-scale forms, name_rs<FMT, RS>: those
    # are checked, the dispatcher, which only calls them, is not)
    kernels = {n: body for n, body in funcs.items() if QUANTIZED.search(n) and "_scalar" not in n
               and not ("_rs<" in body and "_rs<" not in n)}
    assert any("_rs<" in n for n in kernels), "no block-scale form (name_rs<FMT, RS>) among the kernels"
    assert kernels, "no quantized dot kernel among the extension's functions (renamed or all inlined?)"
    kernels.update({n: body for n, body in funcs.items() if BF16.search(n)})
    missing = sorted(n for n, body in kernels.items() if "prefetch" not in body)
    assert not missing, f"kernels without a prefetch instruction: {missing}"
