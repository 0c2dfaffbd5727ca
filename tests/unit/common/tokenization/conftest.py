import pytest

from services.common.tokenization import ChatTokenizer
from tests.unit.engine.tiny import tiny_model_dir


@pytest.fixture(scope="session")
def model_dir():
    return tiny_model_dir()


@pytest.fixture(scope="session")
def tok(model_dir):
    return ChatTokenizer.load(model_dir)
