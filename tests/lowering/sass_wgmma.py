"""SASS check for register-operand warpgroup MMAs (used by the wgmma kernels' compile tests).

An HGMMA whose A operand comes from registers reads them while it runs, until the ``WARPGROUP.DEPBAR``
that retires it; ptxas does not stop later instructions from writing them before that (an earlier version's
register-operand kernel gave garbage on the GPU for this reason, docs/kernels.md). ``inflight_writes``
lists every write to an in-flight HGMMA's A registers: in the K loop taken as a cycle (a group issued in one
step is retired by the ``DEPBAR.LE gsb0, 0x1`` after the next step's issue: the second barrier on), and in
the straight-line code around it (an odd tail step; a ``0x0`` barrier retires everything).
"""
from __future__ import annotations

import re
import subprocess
import tempfile

_LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_NO_DEST = ("ST", "HGMMA", "BRA", "BAR", "WARPGROUP", "SYNCS", "UTMA", "RED", "EXIT", "NOP", "WARPSYNC")


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, text) of every instruction in ``cuobjdump -sass`` output."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(_LINE.match, sass.splitlines()) if m]


def _hgmma_loops(ins: list[tuple[int, str]]) -> list[tuple[bool, int, int]]:
    """(holds a register-operand HGMMA, first, last) of every backward-branch loop that holds an HGMMA."""
    loops = []
    for j, (a, t) in enumerate(ins):
        m = re.search(r"BRA (0x[0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a:
            first = next(i for i, (aa, _) in enumerate(ins) if aa >= int(m.group(1), 16))
            body = [tt for _, tt in ins[first:j + 1] if "HGMMA" in tt]
            if body:
                loops.append((any(a_registers(tt) for tt in body), first, j))
    return loops


def _loop_bounds(ins: list[tuple[int, str]]) -> tuple[int, int]:
    """Indices (first, last) of the innermost backward-branch loop that holds a register-operand HGMMA (else,
    one that holds any HGMMA: a kernel with a shared-memory-operand loop too, such as the in-launch EC's
    shrink role, is checked on the register-operand one)."""
    loops = _hgmma_loops(ins)
    if not loops:
        raise ValueError("no loop with an HGMMA in this SASS")
    _, first, last = next((lp for lp in loops if lp[0]), loops[0])
    return first, last


def ra_loops(sass: str) -> list[tuple[int, int]]:
    """(first, last) of every innermost loop that holds a register-operand HGMMA; a loop with another HGMMA loop's backward branch inside is left
    out (ptxas lays the outer loops out as overlapping ranges, not nested ones)."""
    loops = _hgmma_loops(instructions(sass))
    ends = {la for _, _, la in loops}  # (innermost: no other HGMMA loop's backward branch inside)
    return [(f, la) for ra, f, la in loops if ra and not any(f <= e < la for e in ends)]


def hgmma_loop(sass: str) -> list[str]:
    """The instructions of the innermost backward-branch loop that holds an HGMMA."""
    ins = instructions(sass)
    first, last = _loop_bounds(ins)
    return [t for _, t in ins[first:last + 1]]


def a_registers(text: str) -> set[int]:
    """The 4 A registers of a register-operand HGMMA (none for a shared-memory A descriptor)."""
    m = re.search(r"HGMMA\.\S+ R\d+, R(\d+),", text)
    return set(range(int(m.group(1)), int(m.group(1)) + 4)) if m else set()


def written(text: str) -> set[int]:
    """Registers an instruction writes: its first operand (.64 / .WIDE: 2, .128: 4; LDSM .x2 / .x4: 2 / 4)."""
    t = re.sub(r"^@!?U?P\w+\s+", "", text)
    op, _, rest = t.partition(" ")
    m = re.match(r"R(\d+)", rest.strip())
    if op.startswith(_NO_DEST) or not m:
        return set()
    width = 4 if (".128" in op or ".X4" in op) else 2 if (".64" in op or ".WIDE" in op or ".X2" in op) else 1
    return set(range(int(m.group(1)), int(m.group(1)) + width))


def _retired_window(texts: list[str], p: int, cyclic: bool) -> list[str]:
    """Instructions after position p until the DEPBAR that retires the HGMMA group issued at p: the second
    ``DEPBAR.LE gsb0, 0x1`` (one group may stay pending) or the first ``0x0``."""
    out, barriers, n = [], 0, len(texts)
    for q in range(1, n + 1 if cyclic else n - p):
        u = texts[(p + q) % n] if cyclic else texts[p + q]
        if "WARPGROUP.DEPBAR" in u:
            barriers += 1
            if barriers == 2 or u.endswith("0x0"):
                break
        out.append(u)
    return out


def inflight_writes(sass: str) -> list[tuple[str, str]]:
    """(HGMMA, instruction) pairs where the instruction overwrites the HGMMA's A registers before it retires:
    in every innermost register-operand K loop taken as a cycle (``ra_loops``; else the one ``_loop_bounds``
    finds), and in the straight-line code outside them (a tail step)."""
    ins = instructions(sass)
    loops = ra_loops(sass) or [_loop_bounds(ins)]
    texts = [t for _, t in ins]
    bad = []
    for p, text in enumerate(texts):
        regs = a_registers(text)
        if not regs:
            continue
        inside = next(((f, la) for f, la in loops if f <= p <= la), None)
        if inside:
            window = _retired_window(texts[inside[0]:inside[1] + 1], p - inside[0], True)
        else:
            window = _retired_window(texts, p, False)
        bad += [(text, u) for u in window if written(u) & regs]
    return bad


def nvidia_tool(name: str) -> str:
    """The path of the CUDA tool Triton itself uses (``ptxas``, ``cuobjdump``): the one its
    ``TRITON_<NAME>_PATH`` variable names, else the copy in Triton's wheel. Triton picks the PTX version
    it emits from that ptxas, so a test that runs a different one can see PTX newer than it reads (on a
    CUDA 13 machine: "Unsupported .version 9.0; current version is '8.7'")."""
    from triton import knobs

    tool = getattr(knobs.nvidia, name)  # the knob resolves to an NvidiaTool (path, version) or None
    assert tool is not None, f"Triton finds no {name} (set TRITON_{name.upper()}_PATH)"
    return tool.path


def compile_sass(ptx: str) -> tuple[str, str]:
    """(ptxas -v log, cuobjdump -sass text) of a PTX module for sm_90a, with the tools Triton uses."""
    with tempfile.TemporaryDirectory() as d:
        open(f"{d}/k.ptx", "w").write(ptx)
        log = subprocess.run([nvidia_tool("ptxas"), "-arch=sm_90a", "-v", f"{d}/k.ptx", "-o", f"{d}/k.cubin"],
                             capture_output=True, text=True).stderr
        sass = subprocess.run([nvidia_tool("cuobjdump"), "-sass", f"{d}/k.cubin"], capture_output=True,
                              text=True).stdout
    return log, sass
