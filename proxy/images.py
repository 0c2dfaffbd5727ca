"""A call's images: read from the request, stored by digest, placed in the prompt.

Every protocol's image input (OpenAI ``image_url`` parts, Anthropic ``image`` blocks,
Gemini ``inlineData``, Responses ``input_image``) is a data URL in the normalized
conversation. The proxy decodes each one, names it by the sha256 of its bytes, stores
the bytes in the object store under that name (once per process per image, before the
record that names it is committed), and records where its tokens sit in the prompt
(``schemas.ImageSpan``). The engine gets the images beside the prompt ids, in order.
"""

from __future__ import annotations

import base64
import logging
from dataclasses import dataclass

from proxy.errors import ProtocolError, UpstreamError
from schemas import ImageSpan
from schemas import subjects as S
from services.common.tokenization import ChatTokenizer
from services.common.tokenization.images import (
    IMAGE_PART_TYPES,
    ImageInputError,
    decode_image_url,
    image_digest,
)
from services.common.tokenization.lru import SizedLRU

log = logging.getLogger("polar.proxy")
STORED_DIGESTS = 100_000  # digests this process knows are in the object store


@dataclass(frozen=True)
class PromptImage:
    digest: str
    media_type: str
    data: bytes
    sent: str = ""  # the base64 text as the request carried it

    @property
    def base64(self) -> str:
        return base64.b64encode(self.data).decode("ascii")


def read_images(urls: list[str]) -> list[PromptImage]:
    """The request's images, decoded; a 400 in the caller's protocol for one that is not
    inline data (nothing here fetches URLs)."""
    out = []
    for i, url in enumerate(urls):
        try:
            media_type, data = decode_image_url(url)
        except ImageInputError as exc:
            raise ProtocolError(400, f"image {i}: {exc}") from exc
        out.append(PromptImage(image_digest(data), media_type, data, url.partition(",")[2]))
    return out


def images_by_digest(raw: bytes, images: list[PromptImage]) -> bytes:
    """``raw`` (a request body) with each image's base64 replaced by its digest: records
    keep the request verbatim but for the images' bytes."""
    for image in images:
        if image.sent:
            raw = raw.replace(image.sent.encode(), image.digest.encode())
    return raw


def messages_by_digest(messages: list[dict], images: list[PromptImage]) -> list[dict]:
    """OpenAI-shaped messages with each image part's URL replaced by its image's digest
    (parts in template order, as ``image_urls`` lists them)."""
    left = iter(images)
    out = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list) or not any(_is_image(p) for p in content):
            out.append(message)
            continue
        parts = [
            {"type": "image_url", "image_url": {"url": next(left).digest}} if _is_image(p) else p
            for p in content
        ]
        out.append({**message, "content": parts})
    return out


def _is_image(part) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES


def place(
    prompt_ids: list[int], tok: ChatTokenizer | None, images: list[PromptImage]
) -> tuple[ImageSpan, ...]:
    """Where each image's tokens sit in ``prompt_ids``, in order. A model whose
    tokenizer the proxy does not know (chat mode without ``model_dir``) gets start -1:
    the engine placed them and did not say where."""
    if not images:
        return ()
    if tok is None or tok.images is None:
        return tuple(ImageSpan(digest=im.digest, start=-1, length=0) for im in images)
    try:
        spans = tok.images.spans(prompt_ids)
    except ImageInputError as exc:
        raise ProtocolError(400, str(exc)) from exc
    if len(spans) != len(images):
        raise ProtocolError(
            400, f"the prompt holds {len(spans)} image(s), the request {len(images)}"
        )
    return tuple(
        ImageSpan(digest=im.digest, start=start, length=length, media_type=im.media_type)
        for im, (start, length) in zip(images, spans, strict=True)
    )


def place_sampled(
    prompt_ids: list[int], tok: ChatTokenizer | None, images: list[PromptImage]
) -> tuple[ImageSpan, ...]:
    """``place`` for a prompt the engine templated and already sampled from (chat mode):
    one the proxy's tokenizer cannot read costs the spans (start -1), not the call."""
    try:
        return place(prompt_ids, tok, images)
    except ProtocolError as exc:
        log.warning("images of a chat-mode call not placed: %s", exc)
        return place(prompt_ids, None, images)


class ImageStore:
    """Image bytes in the object store, by digest (``subjects.image_object``)."""

    def __init__(self, blobs) -> None:
        self._blobs = blobs  # async () -> nats ObjectStore (``Bus.blobs``)
        self._stored: SizedLRU[str, bool] = SizedLRU(STORED_DIGESTS, lambda _k, _v: 1)

    async def put(self, images: list[PromptImage]) -> None:
        """Store what this process has not stored yet; a failure is the caller's 503
        (a record must never name an image nobody can read)."""
        for image in images:
            if self._stored.get(image.digest):
                continue
            try:
                await (await self._blobs()).put(S.image_object(image.digest), image.data)
            except Exception as exc:  # noqa: BLE001 - any failure: the image is not kept
                raise UpstreamError(503, f"image store failed: {exc}") from exc
            self._stored.put(image.digest, True)
