"""Compiling a hand-specified Triton kernel variant for a GPU target without a GPU, to read its
reduction layouts (the recorded variants of the families' workloads: tests/kernels/test_compile_gate.py)."""
from __future__ import annotations

import inspect
import re

from invariant_infer.kernels.offline_compile import compile_kernel


def compile_for(kernel, arch, types, constexprs, num_warps=4, num_stages=3, options=None, aligned=None):
    """Compile ``kernel`` for sm_<arch> with the launches' pinned options (``options`` replaces
    them). ``types`` maps argument names to Triton types (default: pointers from the 'ptr'
    entry, everything else i32). ``aligned``: the arguments specialised as divisible by 16
    (default: the pointers, 16-byte aligned as torch allocates them)."""
    signature, attrs = {}, {}
    for index, name in enumerate(inspect.signature(kernel.fn).parameters):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in types:
            signature[name] = types[name]
        else:
            signature[name] = types["ptr"] if name.endswith("_ptr") else "i32"
        if (signature[name].startswith("*") if aligned is None else name in aligned):
            attrs[(index,)] = [["tt.divisibility", 16]]
    compiled = compile_kernel(kernel, arch, signature, constexprs, attrs,
                              {"num_warps": num_warps, "num_stages": num_stages}, pinned=options)
    assert compiled.asm["cubin"]
    return compiled


def reduction_layouts(compiled) -> list[str]:
    """The operand and result types, layouts spelled out, of every dot and reduction in the TTGIR:
    the layouts fix which thread sums which elements, so equal layouts mean equal summation trees."""
    ttgir = compiled.asm["ttgir"]
    aliases = dict(re.findall(r"^(#\w+) = (.*)$", ttgir, re.M))
    spell = lambda text: re.sub(r"#\w+", lambda m: aliases.get(m.group(0), m.group(0)), text)  # noqa: E731
    ops = [line for line in ttgir.splitlines() if re.search(r"\b(tt\.dot|warp_group_dot) ", line)
           or line.strip().startswith("}) : ")]
    assert ops, "no dot or reduction found"
    return [spell(re.sub(r" loc\(.*$", "", line.rsplit(" : ", 1)[-1])) for line in ops]
