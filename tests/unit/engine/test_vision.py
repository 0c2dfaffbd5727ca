"""The embedded engine's image path: decoding, the encoder, images placed at their pad
tokens through every forward (cached, whole, packed), and the prefix cache keyed by them."""

import base64

import pytest
import torch

from examples.count_stars.images import star_image
from services.common.tokenization import ChatTokenizer
from services.common.tokenization.images import ImageInputError
from services.engine.engine import Engine, EngineConfig, RequestRejected
from services.engine.modelconfig import ModelLoadError, parse_vision
from services.engine.sampling import SamplingParams
from services.engine.sequence import GenerationRequest
from services.engine.vision import patches, place_images, preprocess, read_images
from services.engine.weights import load_model
from tests.unit.engine.tiny import vision_model_dir

FIVE, THREE = star_image(5, seed=1), star_image(3, seed=1)


@pytest.fixture(scope="module")
def vtok():
    return ChatTokenizer.load(vision_model_dir())


@pytest.fixture(scope="module")
def vmodel():
    return load_model(vision_model_dir())


@pytest.fixture
def engine(vmodel, vtok):
    eng = Engine(
        vmodel, vtok.decode, vtok.eos_token_ids, EngineConfig(max_prefill_tokens=8)
    ).start()
    yield eng
    eng.stop()


def url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def prompt_of(vtok, n_images: int = 1) -> list[int]:
    parts = [{"type": "image_url", "image_url": {"url": "x"}}] * n_images
    content = [*parts, {"type": "text", "text": "How many stars?"}]
    return vtok.render_ids([{"role": "user", "content": content}])


def generate(engine, ids, images, vtok, vmodel, seed=3):
    req = GenerationRequest(
        rid="r",
        prompt_ids=ids,
        params=SamplingParams(max_new_tokens=6, temperature=1.0, sampling_seed=seed),
        images=read_images(ids, [url(i) for i in images], vtok.images, vmodel.config.vision),
    )
    return engine.submit(req).result(timeout=60)


def embeds_of(vmodel, images: list[bytes]) -> torch.Tensor:
    size = vmodel.config.vision.image_size
    with torch.no_grad():
        return vmodel.encode_images(torch.stack([preprocess(i, size) for i in images]))


def test_preprocessing_and_encoding_are_deterministic(vmodel):
    a, b = preprocess(FIVE, 64), preprocess(star_image(5, seed=1), 64)
    assert a.shape == (3, 64, 64) and torch.equal(a, b)
    assert float(a.min()) >= -1 and float(a.max()) <= 1
    e = embeds_of(vmodel, [FIVE, FIVE, THREE])
    assert e.shape == (3, 16, vmodel.config.hidden_size)
    assert torch.equal(e[0], e[1]) and not torch.allclose(e[0], e[2])
    # patches are row-major 16x16 squares: the first is the top-left corner
    grid = patches(a[None], 16)
    assert grid.shape == (1, 16, 768)
    assert torch.equal(grid[0, 0].view(3, 16, 16), a[:, :16, :16])


def test_bytes_that_are_no_image_are_refused():
    with pytest.raises(ImageInputError, match="cannot decode image"):
        preprocess(b"not an image", 64)


def test_a_vision_config_must_fit_its_token_count():
    ok = {"image_size": 64, "patch_size": 16, "tokens_per_image": 16, "image_token_id": 5}
    assert parse_vision(ok).patch_dim == 768
    for bad in ({**ok, "tokens_per_image": 15}, {**ok, "patch_size": 0}, {**ok, "patch_size": 24}):
        with pytest.raises(ModelLoadError, match="do not"):
            parse_vision(bad)


def test_request_images_must_match_the_prompts_image_tokens(vtok, vmodel):
    ids = prompt_of(vtok, 2)
    vision = vmodel.config.vision
    with pytest.raises(ImageInputError, match="2 image"):
        read_images(ids, [url(FIVE)], vtok.images, vision)
    with pytest.raises(ImageInputError, match="inline"):
        read_images(ids, ["https://x/a.png", url(FIVE)], vtok.images, vision)
    with pytest.raises(ImageInputError, match="reads no images"):
        read_images(ids, [url(FIVE)], None, None)
    got = read_images(ids, [url(FIVE), url(THREE)], vtok.images, vision)
    assert got.pixels.shape == (2, 3, 64, 64) and [n for _, n in got.spans] == [16, 16]


def test_sampled_logprobs_recompute_with_the_image_and_not_without(engine, vtok, vmodel):
    ids = prompt_of(vtok)
    result = generate(engine, ids, [FIVE], vtok, vmodel)
    spans = vtok.images.spans(ids)
    full, start = ids + result.output_ids, len(ids)
    with torch.no_grad():
        right = place_images(spans, embeds_of(vmodel, [FIVE]), ["five"])
        wrong = place_images(spans, embeds_of(vmodel, [THREE]), ["three"])
        truth = vmodel.teacher_forced_logprobs(full, start, right)
        whole = vmodel.sequence_logprobs([full], [start], [right])[0].tolist()
        other = vmodel.teacher_forced_logprobs(full, start, wrong)
    # the prompt was prefilled in chunks of 8 tokens: the image crossed three of them
    assert max(abs(a - b) for a, b in zip(truth, result.output_logprobs, strict=True)) <= 1e-4
    assert max(abs(a - b) for a, b in zip(whole, result.output_logprobs, strict=True)) <= 1e-4
    assert max(abs(a - b) for a, b in zip(other, result.output_logprobs, strict=True)) > 1e-2


def test_the_prefix_cache_reuses_a_prompt_only_with_its_images(engine, vtok, vmodel):
    ids = prompt_of(vtok)
    start = vtok.images.spans(ids)[0][0]
    first = generate(engine, ids, [FIVE], vtok, vmodel)
    other = generate(engine, ids, [THREE], vtok, vmodel)
    again = generate(engine, ids, [FIVE], vtok, vmodel)
    assert first.cached_tokens == 0
    assert other.cached_tokens == start  # up to the image, not past it
    assert again.cached_tokens == len(ids) - 1
    assert again.output_ids == first.output_ids and other.output_ids != first.output_ids


def test_image_pads_are_never_sampled(engine, vmodel):
    assert engine.never_sample == [vmodel.config.vision.image_token_id]


def test_a_text_model_refuses_images(model, tok, vtok, vmodel):
    ids = prompt_of(vtok)
    images = read_images(ids, [url(FIVE)], vtok.images, vmodel.config.vision)
    eng = Engine(model, tok.decode, tok.eos_token_ids).start()
    try:
        with pytest.raises(RequestRejected, match="reads no images"):
            eng.submit(
                GenerationRequest(
                    rid="r", prompt_ids=[1, 2], params=SamplingParams(), images=images
                )
            )
    finally:
        eng.stop()


def test_packed_prompts_share_a_row_only_with_the_same_images(vtok, vmodel):
    ids = prompt_of(vtok)
    spans = vtok.images.spans(ids)
    e = embeds_of(vmodel, [FIVE, THREE])
    five, three = place_images(spans, e[:1], ["5"]), place_images(spans, e[1:], ["3"])
    seqs = [ids + [100, 101], ids + [102, 103], ids + [100, 101]]
    images = [five, five, three]
    with torch.no_grad():
        packed = vmodel.shared_prefix_logprobs(seqs, [len(ids)] * 3, images)
        alone = vmodel.sequence_logprobs(seqs, [len(ids)] * 3, images)
    for p, a in zip(packed, alone, strict=True):
        assert torch.allclose(p, a, atol=1e-5)
    assert not torch.allclose(packed[0], packed[2], atol=1e-3)  # same tokens, other image
