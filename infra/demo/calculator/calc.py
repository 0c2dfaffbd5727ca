"""A tiny calculator with a bug for the demo agent to fix."""


def add(a: float, b: float) -> float:
    return a - b


def sub(a: float, b: float) -> float:
    return a - b


def mul(a: float, b: float) -> float:
    return a * b


def div(a: float, b: float) -> float:
    if b == 0:
        raise ZeroDivisionError("division by zero")
    return a / b
