"""The quantized CPU kernels keep their software prefetch in the built extension.

A prefetch has no effect on results, so no numerical test can see it go: GCC 12 compiled a
four-case switch over the prefetch hint (moe_cpu.cpp prefetch_line) into nothing, and the fp4
and fp8 kernels ran without look-ahead for a day of measurements (2-core dev machine, MXFP4 at
2 threads: 11.3 GB/s without, 17.1-17.8 with; int8 path 14.7 against 21.0-22.9). This reads
the extension's disassembly instead."""
import re
import shutil
import subprocess

import pytest

from freetoken.experts.cpu import extension

KERNEL = re.compile(r"qdot4_(fp4|fp8)_\w+")


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
    kernels = {n: body for n, body in funcs.items() if KERNEL.search(n) and "_scalar" not in n}
    assert kernels, "no quantized dot kernel among the extension's functions (renamed or all inlined?)"
    missing = sorted(n for n, body in kernels.items() if "prefetch" not in body)
    assert not missing, f"kernels without a prefetch instruction: {missing}"
