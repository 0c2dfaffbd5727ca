"""Images through every protocol that carries them, into an engine that reads them.

Real SDKs (OpenAI chat, OpenAI Responses, Anthropic, google-genai) send a star image
through the proxy to the embedded engine serving the tiny vision model. Each call's
record names the image by digest at its token span in the prompt, the bytes are in the
object store under that digest, and a teacher-forced pass of the model over the
captured tokens, with the stored image, gives the captured logprobs (another image
does not: the engine read this one), for single calls and for a merged two-image trace.
"""

import base64
import statistics

import anthropic
import msgspec
import openai
import pytest
import torch
from google import genai
from google.genai import types as gt

from examples.count_stars.images import star_image
from schemas import CompletionRecord, ImageSpan, Outcome, decode
from schemas import subjects as S
from schemas.completion import reconstruct_prompts
from services.builder.strategies.prefix_merging import PrefixMerging
from services.common.registry import Registry
from services.common.tokenization.images import image_digest
from services.engine.vision import place_images, preprocess
from services.engine.weights import load_model
from tests.helpers.stack import EmbeddedServer, running_session, start_proxy
from tests.unit.engine.tiny import vision_model_dir

pytestmark = pytest.mark.asyncio
QUESTION = "How many stars are in this image? Answer with a number."
FIVE, THREE = star_image(5, seed=1), star_image(3, seed=1)
MATCH = 1e-4  # the text path's bound (test_engine_server, test_proxy_tito)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    srv = EmbeddedServer(vision_model_dir(), log_dir=tmp_path_factory.mktemp("e")).wait()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def proxy(engine, nats_url, redis_url, tmp_path_factory):
    logs = tmp_path_factory.mktemp("p")
    p = start_proxy(nats_url, redis_url, engine.url, vision_model_dir(), logs, mode="token")
    yield p
    p.stop()


@pytest.fixture(scope="module")
def chat_proxy(engine, nats_url, redis_url, tmp_path_factory):
    logs = tmp_path_factory.mktemp("c")
    p = start_proxy(nats_url, redis_url, engine.url, vision_model_dir(), logs, mode="chat")
    yield p
    p.stop()


@pytest.fixture(scope="module")
def model():
    return load_model(vision_model_dir())


async def records(bus, session_id: str, expect: int) -> list[CompletionRecord]:
    sub = await bus.js.subscribe(S.completions(session_id), ordered_consumer=True)
    try:
        return [
            decode(await bus.payload(await sub.next_msg(timeout=10)), CompletionRecord)
            for _ in range(expect)
        ]
    finally:
        await sub.unsubscribe()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


async def openai_chat(url: str, token: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{url}/s/{token}/v1", api_key="unused")
    content = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(FIVE)}},
        {"type": "text", "text": QUESTION},
    ]
    await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": content}], max_tokens=6
    )


async def openai_responses(url: str, token: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{url}/s/{token}/v1", api_key="unused")
    content = [
        {"type": "input_image", "image_url": "data:image/png;base64," + b64(FIVE)},
        {"type": "input_text", "text": QUESTION},
    ]
    await client.responses.create(
        model="m", input=[{"role": "user", "content": content}], max_output_tokens=6
    )


async def anthropic_messages(url: str, token: str) -> None:
    client = anthropic.AsyncAnthropic(base_url=url, api_key=token)
    source = {"type": "base64", "media_type": "image/png", "data": b64(FIVE)}
    await client.messages.create(
        model="m",
        max_tokens=6,
        messages=[
            {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": QUESTION}]}
        ],
    )  # fmt: skip


async def gemini(url: str, token: str) -> None:
    client = genai.Client(api_key=token, http_options=gt.HttpOptions(base_url=url))
    parts = [gt.Part.from_bytes(data=FIVE, mime_type="image/png"), gt.Part(text=QUESTION)]
    await client.aio.models.generate_content(
        model="m",
        contents=[gt.Content(role="user", parts=parts)],
        config=gt.GenerateContentConfig(max_output_tokens=6),
    )


CALLERS = {
    "openai_chat": openai_chat,
    "openai_responses": openai_responses,
    "anthropic_messages": anthropic_messages,
    "gemini": gemini,
}


def recompute(model, prompt: list[int], rec: CompletionRecord, image: bytes) -> list[float]:
    """Teacher-forced logprobs of the record's output, ``image`` at its recorded span."""
    pixels = preprocess(image, model.config.vision.image_size)[None]
    spans = [(im.start, im.length) for im in rec.images]
    placed = place_images(spans, model.encode_images(pixels), [image_digest(image)])
    return model.teacher_forced_logprobs(prompt + rec.output_ids, len(prompt), placed)


async def test_every_protocol_captures_the_image_by_digest_and_place(
    proxy, engine, bus, redis_client, model
):
    pad = model.config.vision.image_token_id
    digest = image_digest(FIVE)
    reg = Registry(redis_client)
    diffs, others = {}, {}
    for protocol, call in CALLERS.items():
        (session,) = await running_session(reg, f"img-{protocol}")
        await call(proxy.url, session.token)
        (rec,) = await records(bus, session.session_id, 1)
        assert rec.protocol == protocol and rec.mode == "token"
        assert rec.images == [ImageSpan(digest=digest, start=4, length=16, media_type="image/png")]
        prompt = reconstruct_prompts([rec])[0]
        assert prompt[4:20] == [pad] * 16 and pad not in prompt[20:] + rec.output_ids
        # the record holds no bytes: the request and conversation name the image by
        # digest, its bytes are in the object store under that digest
        assert b64(FIVE)[:64] not in msgspec.json.encode(rec).decode()
        assert digest in bytes(rec.raw_request).decode()
        assert digest in bytes(rec.normalized).decode()
        stored = await (await bus.blobs()).get(S.image_object(digest))
        assert stored.data == FIVE
        with torch.no_grad():
            truth = recompute(model, prompt, rec, FIVE)
            other = recompute(model, prompt, rec, THREE)
        diffs[protocol] = max(abs(a - b) for a, b in zip(truth, rec.output_logprobs, strict=True))
        others[protocol] = max(abs(a - b) for a, b in zip(other, rec.output_logprobs, strict=True))
    print("teacher-forced |Δ| with the stored image:", diffs)
    print("... with another image in its place:", others)
    assert max(diffs.values()) <= MATCH
    assert statistics.fmean(others.values()) > 100 * MATCH  # the engine read the image


async def test_chat_mode_records_the_image_the_engine_templated(
    chat_proxy, bus, redis_client, model
):
    (session,) = await running_session(Registry(redis_client), "img-chat-mode")
    await openai_chat(chat_proxy.url, session.token)
    (rec,) = await records(bus, session.session_id, 1)
    assert rec.mode == "chat" and rec.images[0].digest == image_digest(FIVE)
    prompt = reconstruct_prompts([rec])[0]
    with torch.no_grad():
        truth = recompute(model, prompt, rec, FIVE)
    assert max(abs(a - b) for a, b in zip(truth, rec.output_logprobs, strict=True)) <= MATCH


async def test_an_image_the_proxy_cannot_pass_on_is_a_400_in_the_callers_protocol(
    proxy, redis_client
):
    (session,) = await running_session(Registry(redis_client), "img-bad")
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/s/{session.token}/v1", api_key="unused")
    remote = [{"type": "image_url", "image_url": {"url": "https://example.com/stars.png"}}]
    with pytest.raises(openai.BadRequestError, match="not inline data"):
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": remote}], max_tokens=2
        )
    garbled = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@@"}}]
    with pytest.raises(openai.BadRequestError, match="not valid base64"):
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": garbled}], max_tokens=2
        )
    anth = anthropic.AsyncAnthropic(base_url=proxy.url, api_key=session.token)
    not_an_image = {"type": "base64", "media_type": "image/png", "data": b64(b"not a png")}
    with pytest.raises(anthropic.BadRequestError, match="cannot decode image"):
        await anth.messages.create(
            model="m",
            max_tokens=2,
            messages=[{"role": "user", "content": [{"type": "image", "source": not_an_image}]}],
        )


async def test_gemini_inline_text_is_read_as_text_and_a_pdf_is_a_400(proxy, bus, redis_client):
    """Inline data the SDK sends for a file: text/* is the file's text in the prompt, a
    PDF (which the prompt cannot hold) a 400 in Gemini's shape naming the field."""
    (session,) = await running_session(Registry(redis_client), "gemini-text-file")
    client = genai.Client(api_key=session.token, http_options=gt.HttpOptions(base_url=proxy.url))
    notes = "The grass is green and the sky is blue."
    parts = [
        gt.Part.from_bytes(data=notes.encode(), mime_type="text/plain"),
        gt.Part(text=QUESTION),
    ]
    await client.aio.models.generate_content(
        model="m",
        contents=[gt.Content(role="user", parts=parts)],
        config=gt.GenerateContentConfig(max_output_tokens=4),
    )
    (rec,) = await records(bus, session.session_id, 1)
    (message,) = msgspec.json.decode(bytes(rec.normalized))["messages"]
    assert message["role"] == "user" and notes in str(message["content"])
    assert rec.images == [] and len(rec.prompt_ids) > 20
    pdf = gt.Part.from_bytes(data=b"%PDF-1.4\n", mime_type="application/pdf")
    with pytest.raises(genai.errors.ClientError) as err:
        await client.aio.models.generate_content(
            model="m", contents=[gt.Content(role="user", parts=[pdf, gt.Part(text=QUESTION)])]
        )
    assert err.value.code == 400 and "inlineData.mimeType" in str(err.value)


async def test_a_merged_image_trace_recomputes_to_its_captured_logprobs(
    proxy, bus, redis_client, model
):
    """Two turns, an image in each: the second call extends the first token for token,
    the merged trace names both images at their places, and a teacher-forced pass over
    the whole trace with the images read back by digest gives every sampled logprob."""
    (session,) = await running_session(Registry(redis_client), "img-trace")
    client = openai.AsyncOpenAI(base_url=f"{proxy.url}/s/{session.token}/v1", api_key="x")

    def turn(image: bytes, text: str) -> dict:
        part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(image)}}
        return {"role": "user", "content": [part, {"type": "text", "text": text}]}

    messages = [turn(FIVE, QUESTION)]
    first = await client.chat.completions.create(model="m", messages=messages, max_tokens=6)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        turn(THREE, "And in this one?"),
    ]
    await client.chat.completions.create(model="m", messages=messages, max_tokens=6)
    recs = await records(bus, session.session_id, 2)
    assert recs[1].extends_previous is True
    # the session's TITO states name the images by digest too: no bytes in Redis
    states = await redis_client.lrange(S.key_tito(session.session_id, 0), 0, -1)
    assert states and not any(b64(FIVE)[:64].encode() in st for st in states)
    assert all(image_digest(FIVE).encode() in st for st in states)
    (trace,), *_ = PrefixMerging().build(recs, {}, Outcome.COMPLETED)
    assert [im.digest for im in trace.images] == [image_digest(FIVE), image_digest(THREE)]
    tokens = trace.prompt_ids + trace.response_ids
    pad = model.config.vision.image_token_id
    assert all(tokens[im.start : im.start + im.length] == [pad] * 16 for im in trace.images)
    blobs = await bus.blobs()
    data = [(await blobs.get(S.image_object(im.digest))).data for im in trace.images]
    size = model.config.vision.image_size
    with torch.no_grad():
        embeds = model.encode_images(torch.stack([preprocess(d, size) for d in data]))
        placed = place_images([(im.start, im.length) for im in trace.images], embeds)
        start = len(trace.prompt_ids)
        got = model.sequence_logprobs([tokens], [start], [placed])[0].tolist()
    sampled = [
        (g, c) for g, c, m in zip(got, trace.response_logprobs, trace.loss_mask, strict=True) if m
    ]
    diff = max(abs(g - c) for g, c in sampled)
    print(f"merged image trace: {len(sampled)} sampled tokens, max |Δ| {diff:.1e}")
    assert len(sampled) == sum(len(r.output_ids) for r in recs) and diff <= MATCH
