"""Kernel choice: ``route(problem) -> Route`` (``route.py``), the typed tuned table (``table.py``) and the
CUDA implementations of the spear ops (``cuda.py``). Submodules are imported by name; this package's
own import pulls in nothing, so the kernels below it may read the table without a cycle."""
