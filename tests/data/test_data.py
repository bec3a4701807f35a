"""Shakespeare reader, windows and perplexity."""
import math

import pytest
import torch

from spear_compile.data import DEFAULT_EVAL_PLAYS, list_texts, perplexity, read_text, windows


def test_sdist_has_the_plays():
    names = list_texts()
    assert len(names) >= 70 and all(p in names for p in DEFAULT_EVAL_PLAYS)
    text = read_text("hamlet_gut")
    assert "To be, or not to be" in text or "To be, or not to be".lower() in text.lower()


def test_read_text_unknown_name_is_clear():
    with pytest.raises(KeyError, match="no text 'hamlett'"):
        read_text("hamlett")


def test_windows_drop_tail_and_reject_short():
    w = windows(torch.arange(10), 3)
    assert w.tolist() == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    with pytest.raises(ValueError, match="fewer than one window"):
        windows(torch.arange(2), 3)


def test_perplexity_of_uniform_model_is_vocab_size():
    V = 17

    def uniform(batch):
        return torch.zeros(*batch.shape, V)

    wins = torch.randint(0, V, (4, 9))
    assert math.isclose(perplexity(uniform, wins, progress=False), V, rel_tol=1e-6)


def test_perplexity_matches_manual_nll():
    V = 11
    torch.manual_seed(0)
    table = torch.randn(V, V)

    def bigram(batch):
        return table[batch]

    wins = torch.randint(0, V, (3, 6))
    logp = torch.log_softmax(table, -1)
    nll = -sum(logp[w[i], w[i + 1]] for w in wins for i in range(5)) / 15
    assert math.isclose(perplexity(bigram, wins, batch_size=2, progress=False), math.exp(nll), rel_tol=1e-5)
