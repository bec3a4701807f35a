"""SASS check for register-operand warpgroup MMAs (used by the wgmma kernels' compile tests).

An HGMMA whose A operand comes from registers reads them while it runs, until the ``WARPGROUP.DEPBAR``
that retires it; ptxas does not stop later instructions from writing them before that (session 15's
register-operand kernel gave garbage on the GPU for this reason, benchmarks/NOTES.md). ``inflight_writes``
lists every write to an in-flight HGMMA's A registers in the K loop, taken as a cycle (a group issued in one
step is retired by the ``DEPBAR.LE gsb0, 0x1`` after the next step's issue: the second barrier on).
"""
from __future__ import annotations

import re

_LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_NO_DEST = ("ST", "HGMMA", "BRA", "BAR", "WARPGROUP", "SYNCS", "UTMA", "RED", "ATOM", "EXIT", "NOP", "WARPSYNC")


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, text) of every instruction in ``cuobjdump -sass`` output."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(_LINE.match, sass.splitlines()) if m]


def hgmma_loop(sass: str) -> list[str]:
    """The instructions of the innermost backward-branch loop that holds an HGMMA."""
    ins = instructions(sass)
    hg = {a for a, t in ins if "HGMMA" in t}
    for a, t in ins:
        m = re.search(r"BRA (0x[0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a:
            body = [(aa, tt) for aa, tt in ins if int(m.group(1), 16) <= aa <= a]
            if hg & {aa for aa, _ in body}:
                return [tt for _, tt in body]
    raise ValueError("no loop with an HGMMA in this SASS")


def a_registers(text: str) -> set[int]:
    """The 4 A registers of a register-operand HGMMA (none for a shared-memory A descriptor)."""
    m = re.search(r"HGMMA\.\S+ R\d+, R(\d+),", text)
    return set(range(int(m.group(1)), int(m.group(1)) + 4)) if m else set()


def written(text: str) -> set[int]:
    """Registers an instruction writes (its first operand; .64 / .128 loads write 2 / 4)."""
    t = re.sub(r"^@!?U?P\w+\s+", "", text)
    op, _, rest = t.partition(" ")
    m = re.match(r"R(\d+)", rest.strip())
    if op.startswith(_NO_DEST) or not m:
        return set()
    width = 4 if ".128" in op else 2 if ".64" in op else 1
    return set(range(int(m.group(1)), int(m.group(1)) + width))


def inflight_writes(sass: str) -> list[tuple[str, str]]:
    """(HGMMA, instruction) pairs where the instruction overwrites the HGMMA's A registers before it retires."""
    body = hgmma_loop(sass)
    bad = []
    for p, text in enumerate(body):
        regs = a_registers(text)
        barriers = 0
        for q in range(1, len(body) + 1) if regs else ():
            u = body[(p + q) % len(body)]
            if "WARPGROUP.DEPBAR" in u:
                barriers += 1
                if barriers == 2 or u.endswith("0x0"):
                    break
            if written(u) & regs:
                bad.append((text, u))
    return bad
