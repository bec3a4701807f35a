"""Lab: why the one-launch decode EC spins to its limit inside transformers' CUDA graphs.

Runs ``benchmarks/engine_profile.py`` with one of transformers' graph-capture habits switched off, to see
which one the one-launch EC (``lowering/ec_self.py``) trips on:

* ``--habit none``: as transformers does it;
* ``--habit pool``: the eager warm-up before each capture runs outside transformers' graph memory pool.

    python benchmarks/experimental/engine_graph_lab.py --habit pool -- --layers 1 --density 100 ...
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--habit", choices=("none", "pool"), default="none")
    args, rest = ap.parse_known_args()
    if args.habit == "pool":
        from transformers.generation.continuous_batching import model_runner

        names = [n for n in ("memory_pool_context", "mem_pool_ctx") if hasattr(model_runner, n)]
        for n in names:
            setattr(model_runner, n, lambda pool: contextlib.nullcontext())
        print(f"lab: warm-up outside the graph pool (patched model_runner.{names})")
    import engine_profile

    engine_profile.main([a for a in rest if a != "--"])


if __name__ == "__main__":
    main()
