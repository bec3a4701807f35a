"""The repository speaks of the project, not of how it was built.

Contract: no tracked path is named after a work session or a device call, and the README, the docs and the
package never refer to one ("session 12", "call 3"); records are named by topic and date and the text states
measurements with their date and GPU instead (history lives in git).
"""
import os
import re
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: A path component that names a work session or a device call (``s14_call2.sh``, ``raw/session9/``).
BAD_PATH = re.compile(r"session|_call", re.IGNORECASE)

#: Prose that refers to a session or call by number ("session 23", "call 5", "Session12", "calls 3-5").
#: Word-bounded, so identifiers that merely contain the letters (``recall``, ``EvalSession``) do not match.
HISTORY = re.compile(r"\b(?:session|call)s? ?[0-9]", re.IGNORECASE)

#: Where the text is checked: what a reader of the project reads.
TEXT_ROOTS = ("README.md", "docs", "spear_compile")
TEXT_SUFFIXES = (".md", ".py", ".json", ".txt", ".toml", ".cfg", ".sh", ".html", ".css", ".js", ".yaml", ".yml")


def _git_files():
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return [p for p in out.stdout.decode().split("\0") if p]


def test_no_tracked_path_names_a_session_or_call():
    files = _git_files()
    if files is None:
        pytest.skip("not a git checkout (or git is not installed): no tracked paths to check")
    bad = [p for p in files if BAD_PATH.search(p)]
    assert not bad, f"{len(bad)} tracked paths name a session or call, e.g. {bad[:10]}"


def _text_files():
    files = _git_files()
    if files is not None:
        for p in files:
            if any(p == r or p.startswith(r + "/") for r in TEXT_ROOTS) and (p == "README.md" or p.endswith(TEXT_SUFFIXES)):
                if os.path.isfile(os.path.join(ROOT, p)):
                    yield p
        return
    for r in TEXT_ROOTS:
        full = os.path.join(ROOT, r)
        if os.path.isfile(full):
            yield r
        for d, _, names in os.walk(full):
            for n in names:
                if n.endswith(TEXT_SUFFIXES):
                    yield os.path.relpath(os.path.join(d, n), ROOT)


def test_readme_docs_and_package_do_not_refer_to_sessions_or_calls():
    hits = []
    for p in _text_files():
        with open(os.path.join(ROOT, p), encoding="utf-8", errors="replace") as f:
            for i, line in enumerate(f, 1):
                m = HISTORY.search(line)
                if m:
                    hits.append(f"{p}:{i}: {line.strip()[:120]}")
    assert not hits, f"{len(hits)} lines refer to a work session or call:\n" + "\n".join(hits[:40])


def test_the_history_pattern_is_precise():
    for text in ("session 23", "Session12", "call 5", "calls 3-5", "(session 18, calls 5-10)"):
        assert HISTORY.search(text), text
    for text in ("EvalSession(texts)", "recall 0.9", "first_call_s", "the first call", "callable(fn)", "call_s 2"):
        assert not HISTORY.search(text), text


#: A cited repository path: benchmarks/... or docs/..., up to a quote, space or closing bracket.
CITED = re.compile(r"(?<![\w/.])((?:benchmarks|docs)/[\w./*-]+)")


def test_paths_cited_in_readme_and_docs_exist():
    docs = ["README.md"] + [os.path.join("docs", n) for n in sorted(os.listdir(os.path.join(ROOT, "docs")))
                            if n.endswith(".md")]
    missing = []
    for p in docs:
        with open(os.path.join(ROOT, p), encoding="utf-8") as f:
            text = f.read()
        for m in CITED.finditer(text):
            cited = m.group(1).rstrip(".,;:")
            if any(c in cited for c in "*<>") or cited.endswith(("/OUT", "/DIR")):
                continue  # a pattern or a placeholder, not a path
            if not os.path.exists(os.path.join(ROOT, cited)):
                missing.append(f"{p}: {cited}")
    assert not missing, "cited paths that do not exist:\n" + "\n".join(missing)
