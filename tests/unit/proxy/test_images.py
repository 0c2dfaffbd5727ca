"""The proxy's image handling: decoding to digests, records without bytes, spans, TITO."""

import base64

import orjson
import pytest

from proxy.backends.base import BackendError, ErrorKind, TokenRequest
from proxy.backends.vllm import VLLMBackend
from proxy.errors import ProtocolError
from proxy.images import images_by_digest, messages_by_digest, place, place_sampled, read_images
from proxy.tito import TurnState, pack, plan_token_prompt, same_message, tools_key
from schemas import ImageSpan
from services.common.tokenization import ChatTokenizer
from services.common.tokenization.images import image_digest
from tests.unit.engine.tiny import vision_model_dir

PNG_A, PNG_B = b"\x89PNG-a", b"\x89PNG-b"


def url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def user(*images: bytes, text: str = "how many?") -> dict:
    parts = [{"type": "image_url", "image_url": {"url": url(i)}} for i in images]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def test_images_are_read_to_digests_and_a_bad_one_is_a_400():
    (a,) = read_images([url(PNG_A)])
    assert a.digest == image_digest(PNG_A) and a.media_type == "image/png" and a.data == PNG_A
    for bad in ("https://x/y.png", "data:image/png;base64,!!"):
        with pytest.raises(ProtocolError) as exc:
            read_images([url(PNG_A), bad])
        assert exc.value.status == 400 and str(exc.value).startswith("image 1:")


def test_the_record_keeps_the_request_with_digests_in_place_of_bytes():
    messages = [{"role": "system", "content": "s"}, user(PNG_A, PNG_B)]
    raw = orjson.dumps({"model": "m", "messages": messages})
    images = read_images([url(PNG_A), url(PNG_B)])
    kept = orjson.loads(images_by_digest(raw, images))
    parts = kept["messages"][1]["content"]
    assert parts[0]["image_url"]["url"] == "data:image/png;base64," + image_digest(PNG_A)
    assert parts[1]["image_url"]["url"] == "data:image/png;base64," + image_digest(PNG_B)
    named = messages_by_digest(messages, images)
    assert named[0] is messages[0]
    assert [p.get("image_url") for p in named[1]["content"]][:2] == [
        {"url": image_digest(PNG_A)},
        {"url": image_digest(PNG_B)},
    ]
    assert messages[1]["content"][0]["image_url"]["url"] == url(PNG_A)  # not changed


def test_spans_are_placed_in_order_and_must_match_the_images():
    tok = ChatTokenizer.load(vision_model_dir())
    ids = tok.render_ids([user(PNG_A, PNG_B)])
    images = read_images([url(PNG_A), url(PNG_B)])
    a, b = place(ids, tok, images)
    assert a == ImageSpan(digest=images[0].digest, start=a.start, length=16, media_type="image/png")
    assert b.start > a.start and b.digest == images[1].digest
    with pytest.raises(ProtocolError, match="holds 2 image"):
        place(ids, tok, images[:1])
    # a tokenizer that does not know where images go (chat mode, no model_dir): start -1
    assert place(ids, None, images[:1])[0].start == -1


def test_a_turn_with_another_image_is_another_message():
    assert same_message(user(PNG_A), user(PNG_A))
    assert not same_message(user(PNG_A), user(PNG_B))
    assert not same_message(user(PNG_A), user(text="how many?"))


async def test_vllm_token_mode_refuses_images_naming_chat_mode():
    backend = VLLMBackend("http://127.0.0.1:9")  # refused before any request is made
    request = TokenRequest(session_id="s", input_ids=[1, 2], image_data=["AA=="])
    with pytest.raises(BackendError, match="chat mode") as exc:
        await backend.generate(request)
    assert exc.value.status == 400 and exc.value.kind is ErrorKind.UNSUPPORTED
    await backend.aclose()


def test_a_second_turn_with_a_new_image_extends_the_first_token_for_token():
    tok = ChatTokenizer.load(vision_model_dir())
    first = [user(PNG_A)]
    prompt = tok.render_ids(first)
    reply = {"role": "assistant", "content": "5"}
    output = tok.encode(tok.assistant_reply_text(reply))
    turn = TurnState(
        seq=0, messages=first, reply=reply, tools_key=tools_key(None),
        prompt=pack(prompt), output=pack(output),
    )  # fmt: skip
    second = [*first, reply, user(PNG_B, text="and now?")]
    plan = plan_token_prompt(tok, second, None, [turn])
    assert plan.extends is True and plan.prompt_ids[: len(prompt + output)] == prompt + output
    assert plan.prompt_ids == tok.render_ids(second)  # the same ids as rendering it whole
    images = read_images([url(PNG_A), url(PNG_B)])
    a, b = place(plan.prompt_ids, tok, images)
    assert a.start < len(prompt) < b.start and b.length == 16
    # the same turn with the first image swapped extends nothing
    swapped = [user(PNG_B), reply, user(PNG_B, text="and now?")]
    assert plan_token_prompt(tok, swapped, None, [turn]).extends is False


def test_a_sampled_prompt_the_proxy_cannot_read_loses_its_spans_not_the_call():
    tok = ChatTokenizer.load(vision_model_dir())
    ids = tok.render_ids([user(PNG_A)])
    images = read_images([url(PNG_A), url(PNG_B)])  # one more than the engine's prompt holds
    assert [s.start for s in place_sampled(ids, tok, images)] == [-1, -1]
    assert place_sampled(ids, tok, images[:1]) == place(ids, tok, images[:1])
