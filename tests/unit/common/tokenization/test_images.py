"""Images in prompts: placeholder expansion, spans, digests, data URLs, template order."""

import base64
import hashlib

import pytest

from services.common.tokenization import ChatTokenizer, TemplateRenderError
from services.common.tokenization.images import (
    ImageInputError,
    ImageTokens,
    decode_image_url,
    image_digest,
    image_urls,
)
from tests.unit.engine.tiny import tiny_model_dir, vision_model_dir

PAD = 9
TOKENS = ImageTokens(pad_id=PAD, per_image=3)


def test_each_placeholder_becomes_one_image_of_pads_and_spans_find_them():
    ids = TOKENS.expand([1, PAD, 2, 3, PAD, 4])
    assert ids == [1, PAD, PAD, PAD, 2, 3, PAD, PAD, PAD, 4]
    assert TOKENS.spans(ids) == [(1, 3), (6, 3)]
    # two images side by side are one run of pads, two spans
    assert TOKENS.spans(TOKENS.expand([PAD, PAD])) == [(0, 3), (3, 3)]
    assert TOKENS.expand([1, 2]) == [1, 2] and TOKENS.spans([1, 2]) == []


def test_a_run_that_is_not_whole_images_is_refused():
    with pytest.raises(ImageInputError, match="not a whole number of images"):
        TOKENS.spans([1, PAD, PAD, 2])


def test_image_tokens_come_from_the_vision_config_only():
    assert ImageTokens.from_config(
        {"vision_config": {"image_token_id": 7, "tokens_per_image": 4}}
    ) == ImageTokens(7, 4)
    assert ImageTokens.from_config({"hidden_size": 8}) is None  # fmt: skip


def test_digest_is_the_sha256_of_the_bytes():
    assert image_digest(b"abc") == "sha256:" + hashlib.sha256(b"abc").hexdigest()


def test_data_urls_decode_in_either_base64_alphabet_and_nothing_else_is_taken():
    data = bytes(range(250, 256)) * 3  # base64 with + and / (or - and _)
    std, safe = base64.b64encode(data).decode(), base64.urlsafe_b64encode(data).decode()
    assert "/" in std and "_" in safe
    assert decode_image_url("data:image/png;base64," + std) == ("image/png", data)
    assert decode_image_url("data:image/png;base64," + safe) == ("image/png", data)
    for url, why in (
        ("https://example.com/a.png", "not inline data"),
        ("data:image/png,rawtext", "must be base64"),
        ("data:image/png;base64,@@@", "not valid base64"),
        ("data:image/png;base64,", "empty"),
    ):
        with pytest.raises(ImageInputError, match=why):
            decode_image_url(url)


def test_image_urls_follow_the_template_order():
    messages = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a"}}, {"type": "text", "text": "t"}]},
        {"role": "assistant", "content": "x"},
        {"role": "user", "content": [{"type": "input_image", "image_url": "b"}, {"type": "image_url", "image_url": "c"}]},
    ]  # fmt: skip
    assert image_urls(messages) == ["a", "b", "c"]


def test_a_vision_model_renders_one_image_of_pads_per_image_part():
    tok = ChatTokenizer.load(vision_model_dir())
    content = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
        {"type": "text", "text": "How many?"},
    ]
    ids = tok.render_ids([{"role": "user", "content": content}])
    assert tok.images is not None and tok.images.per_image == 16
    (start, length), = tok.images.spans(ids)  # fmt: skip
    assert length == 16 and ids[start - 1] == tok.tokenizer.token_to_id("<|vision_start|>")
    assert ids[start + length] == tok.tokenizer.token_to_id("<|vision_end|>")
    assert tok.decode(ids[start + length + 1 :]).startswith("How many?")


def test_a_text_model_refuses_image_parts():
    tok = ChatTokenizer.load(tiny_model_dir())
    assert tok.images is None
    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]
    with pytest.raises(TemplateRenderError, match="Only text content parts"):
        tok.render_ids([{"role": "user", "content": content}])
