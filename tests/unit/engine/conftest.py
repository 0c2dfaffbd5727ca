import pytest
import torch

from services.common.tokenization import ChatTokenizer
from services.engine.weights import load_model
from tests.unit.engine.tiny import second_checkpoint, tiny_model_dir

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_dir():
    return tiny_model_dir()


@pytest.fixture(scope="session")
def checkpoint_v2():
    return second_checkpoint()


@pytest.fixture(scope="session")
def tok(model_dir):
    return ChatTokenizer.load(model_dir)


@pytest.fixture(scope="session")
def model(model_dir):
    return load_model(model_dir)
