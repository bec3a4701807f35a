"""The spear command checks every argument before any model loads, shows its defaults, reports its
version, and says in one line what to install when the models extra is missing."""
import re
import sys

import pytest

from spear_compile import __version__
from spear_compile.cli import build_parser, main


@pytest.mark.parametrize("argv,msg", [
    (["inspect", "--rank", "0", "--out", "o"], r"--rank '0': expected a positive integer"),
    (["inspect", "--tokens", "0", "--out", "o"], r"--tokens '0': expected a positive integer"),
    (["inspect", "--group-size", "7", "--out", "o"], r"--group-size '7': expected 0 \(per-channel\) or one of 32"),
    (["eval", "--json", "/no/such/dir/out.json"], r"--json '/no/such/dir/out.json': directory /no/such/dir does not exist"),
    (["demo", "--json", "/no/such/dir/out.json"], r"directory /no/such/dir does not exist"),
    (["eval", "--group-size", "48"], r"--group-size '48': expected 0"),
    (["inspect", "--out", "/dev/null"], r"--out '/dev/null' exists and is not a directory"),
])
def test_bad_arguments_stop_before_anything_loads(argv, msg, capsys, monkeypatch):
    import spear_compile.models as models

    monkeypatch.setattr(models, "load", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert re.search(msg, capsys.readouterr().err)


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith(f"spear_compile {__version__}")


def test_every_flag_has_help_and_shows_its_default():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, p in sub.choices.items():
        text = p.format_help()
        for action in p._actions:
            if not action.option_strings or action.dest == "help":
                continue
            assert action.help, f"spear {name} {action.option_strings[0]} has no help"
            if action.default is not None and action.default is not False and not action.required:
                assert "(default:" in text, name
        assert "(default: 0)" in text or name != "inspect"


def test_missing_models_extra_is_one_line(monkeypatch, tmp_path):
    for mod in [m for m in list(sys.modules) if m == "transformers" or m.startswith("transformers.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ModuleNotFoundError
    with pytest.raises(SystemExit) as e:
        main(["inspect", "--out", str(tmp_path / "o")])
    assert str(e.value) == ("spear inspect: needs the 'models' extra (module 'transformers' is not installed): "
                            "pip install 'spear_compile[models]'")
