"""The trainer takes image-bearing samples: grouping sees the images, the policy encodes
them with its live weights, recomputes the engine's logprobs and trains the encoder too."""

import base64

import msgspec
import pytest
import torch

from examples.count_stars.images import star_image
from schemas import ImageSpan
from services.common.tokenization import ChatTokenizer
from services.common.tokenization.images import image_digest
from services.engine.engine import Engine
from services.engine.sampling import SamplingParams
from services.engine.sequence import GenerationRequest
from services.engine.vision import read_images
from services.engine.weights import load_model
from services.trainer.batch import GroupCounts, Sample, group_samples, image_digests
from services.trainer.policy import Policy, train_step
from tests.unit.engine.tiny import vision_model_dir
from tests.unit.trainer.test_batch import trace, traj
from tests.unit.trainer.test_policy import SETTINGS

FIVE, THREE = star_image(5, seed=1), star_image(3, seed=1)


def captured(image: bytes, seeds: list[int]) -> list[Sample]:
    """Samples as the engine sampled them: one prompt, ``image`` in it, one per seed."""
    tok, model = ChatTokenizer.load(vision_model_dir()), load_model(vision_model_dir())
    content = [
        {"type": "image_url", "image_url": {"url": "x"}},
        {"type": "text", "text": "How many stars?"},
    ]
    ids = tok.render_ids([{"role": "user", "content": content}])
    data = "data:image/png;base64," + base64.b64encode(image).decode()
    images = read_images(ids, [data], tok.images, model.config.vision)
    engine = Engine(model, tok.decode, tok.eos_token_ids).start()
    try:
        results = [
            engine.submit(
                GenerationRequest(
                    rid=f"r{s}",
                    prompt_ids=ids,
                    params=SamplingParams(
                        max_new_tokens=5, temperature=1.0, sampling_seed=s, ignore_eos=True
                    ),
                    images=images,
                )
            ).result(timeout=60)
            for s in seeds
        ]
    finally:
        engine.stop()
    (start, length), = images.spans  # fmt: skip
    span = ImageSpan(digest=image_digest(image), start=start, length=length)
    return [
        Sample(
            task_id="t",
            session_id=f"s{s}",
            trace_index=0,
            tokens=ids + r.output_ids,
            prompt_len=len(ids),
            mask=[1] * len(r.output_ids),
            behavior=r.output_logprobs,
            versions=("0",),
            reward=float(i),
            advantage=1.0 if i % 2 else -1.0,
            images=(span,),
        )
        for i, (s, r) in enumerate(zip(seeds, results, strict=True))
    ]  # fmt: skip


def test_a_step_on_image_samples_recomputes_the_engines_logprobs_and_trains_the_encoder():
    samples = captured(FIVE, [1, 2]) + captured(THREE, [1, 2])
    policy = Policy(vision_model_dir(), lr=1e-3)
    with pytest.raises(KeyError, match="no pixels"):
        train_step(policy, samples, 0, SETTINGS)
    policy.add_images({image_digest(FIVE): FIVE, image_digest(THREE): THREE})
    before = policy.params["visual.patch_embed.weight"].detach().clone()
    stats = train_step(policy, samples, 0, SETTINGS)
    print("image samples: mismatch max", stats.mismatch_max, "over", stats.mismatch_tokens)
    assert stats.mismatch_tokens == 20 and stats.mismatch_max < 1e-4
    assert not torch.equal(before, policy.params["visual.patch_embed.weight"])
    policy.keep_images({image_digest(FIVE)})
    assert set(policy.pixels) == {image_digest(FIVE)}


def test_a_text_model_policy_refuses_images():
    from tests.unit.engine.tiny import tiny_model_dir

    with pytest.raises(ValueError, match="reads no images"):
        Policy(tiny_model_dir(), lr=1e-3).add_images({"sha256:x": FIVE})


def test_prompt_grouping_tells_the_same_prompt_with_other_images_apart():
    five = ImageSpan(digest="sha256:5", start=1, length=1)
    three = ImageSpan(digest="sha256:3", start=1, length=1)
    members = [
        traj(sid, reward, [msgspec.structs.replace(trace(0, reward), images=[im])])
        for sid, reward, im in (("a", 1.0, five), ("b", 0.0, five), ("c", 1.0, three), ("d", 1.0, three))
    ]  # fmt: skip
    counts = GroupCounts()
    samples = group_samples(members, 4, "grpo", "prompt", counts)
    assert [s.images for s in samples] == [(five,), (five,), (three,), (three,)]
    assert image_digests(samples) == {"sha256:5", "sha256:3"}
    # the same prompt ids, two questions: one group per image (the second all right)
    assert counts.zero_variance == 1
    assert [round(s.advantage, 3) for s in samples] == [0.707, -0.707, 0.0, 0.0]
