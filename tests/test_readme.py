"""The README's Python blocks run as written (so it cannot drift from the API again)."""
import os
import re

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _blocks():
    return re.findall(r"```python\n(.*?)```", open(README, encoding="utf-8").read(), flags=re.S)


def test_readme_has_python_blocks():
    assert _blocks(), "README.md has no ```python block to test"


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(_blocks())))
def test_readme_block_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = _blocks()[index]
    exec(compile(code, f"README.md python block {index}", "exec"), {"__name__": "__readme__"})
