"""The built-in letter-counting tool: a task a language model is bad at in its head, because its tokens hide the
letters of a word (reasoning-gym's ``letter_counting``), and a one-line function is exact at."""

from __future__ import annotations


def count_letter(text: str, letter: str) -> str:
    """Count how many times a letter (or any one character) appears in a text, ignoring case.

    Args:
        text: the text to search
        letter: the character to count
    """
    if len(letter) != 1:
        raise ValueError(f"letter must be one character, got {letter!r}")
    return str(text.lower().count(letter.lower()))
