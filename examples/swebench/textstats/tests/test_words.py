from textstats.words import count_words, longest_word


def test_count_simple():
    assert count_words("one two three") == 3


def test_longest():
    assert longest_word("a bb ccc dd") == "ccc"
