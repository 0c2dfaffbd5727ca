import pytest
from calc import add, div, mul, sub


def test_add():
    assert add(2, 3) == 5


def test_add_negative():
    assert add(-2, -3) == -5


def test_sub():
    assert sub(5, 3) == 2


def test_mul():
    assert mul(4, 3) == 12


def test_div():
    assert div(8, 2) == 4


def test_div_by_zero():
    with pytest.raises(ZeroDivisionError):
        div(1, 0)
