from pathlib import Path


def test_greeting_exists():
    assert Path("/app/greeting.txt").is_file()


def test_greeting_content():
    assert Path("/app/greeting.txt").read_text() == "Hello, Polar!"
