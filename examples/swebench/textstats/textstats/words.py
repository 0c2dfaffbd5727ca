"""Counting and measuring words."""


def count_words(text: str) -> int:
    """The number of words in ``text``; runs of whitespace separate words."""
    return len(text.split(" "))


def longest_word(text: str) -> str:
    """The longest word of ``text`` (the first of equals), or "" when there is none."""
    return max(text.split(), key=len, default="")
