"""Images in traces: each trace names the images its tokens hold, at their spans."""

import random

import msgspec

from schemas import ImageSpan, Outcome
from services.builder.strategies.per_request import PerRequest
from services.builder.strategies.prefix_merging import PrefixMerging
from tests.unit.builder.synth import GEN, Capture, glue_after, msg, text

PAD = 50  # an image's pad token in the synthetic template


def image(digest: str, start: int) -> ImageSpan:
    return ImageSpan(digest=digest, start=start, length=4)


def two_turns(second_image: str) -> list:
    """A user turn with image A; the answer; a tool result with another image."""
    rng = random.Random(0)
    first = msg("user", [*text(rng, 3), *[PAD] * 4, *text(rng, 2)]) + GEN
    cap = Capture()
    out0 = [*text(rng, 5), 2]
    a = image("sha256:a", 6)
    cap.call(first, out0, images=[a])
    glue = glue_after(out0, [*[PAD] * 4, 101])
    prompt1 = first + out0 + glue
    b = image(second_image, prompt1.index(PAD, len(first) + len(out0)))
    cap.call(prompt1, [*text(rng, 4), 2], images=[a, b])
    return cap.records


def test_per_request_traces_carry_their_records_images():
    records = two_turns("sha256:b")
    traces, _ = PerRequest().build(records, {}, Outcome.COMPLETED)
    assert [t.images for t in traces] == [records[0].images, records[1].images]
    for t in traces:
        tokens = t.prompt_ids + t.response_ids
        assert all(tokens[im.start : im.start + im.length] == [PAD] * 4 for im in t.images)


def test_a_merged_chain_holds_every_image_of_its_latest_prompt():
    records = two_turns("sha256:b")
    (trace,), *_ = PrefixMerging().build(records, {}, Outcome.COMPLETED)
    assert trace.completion_seqs == [0, 1] and trace.images == records[1].images


def test_a_call_whose_earlier_image_changed_does_not_extend_the_chain():
    records = two_turns("sha256:b")
    changed = records[1].images[:]
    changed[0] = image("sha256:other", changed[0].start)
    records[1] = msgspec.structs.replace(records[1], images=changed)
    traces, *_ = PrefixMerging().build(records, {}, Outcome.COMPLETED)
    assert len(traces) == 2 and [t.images for t in traces] == [records[0].images, changed]
