"""The training page's content from the trainer's JSONL log (no server)."""

from services.dashboard import training

LOG = [
    b'{"type": "step", "step": 1, "reward_mean": 0.1, "loss": 2.0, "mismatch_max": 1e-6, "staleness": {"0": 3, "1": 1}, "clip_fraction": 0.0, "kl": 0.01, "grad_norm": 3.5}',
    b'{"type": "eval", "step": 1, "accuracy": 0.2}',
    b'{"type": "step", "step": 1, "reward_mean": 0.3, "loss": 1.5, "mismatch_max": null, "staleness": {}, "clip_fraction": 0.1, "kl": 0.02, "grad_norm": 2.5}',
    b'{"type": "step", "step": 2, "reward_mean": 0.5, "loss": 1.0, "staleness": {"2": 2}, "clip_fraction": 0.2, "kl": 0.03, "grad_norm": 1.5}',
    b'{"type": "st',  # being written
]


def test_training_curves_last_record_per_step_wins():
    v = training.training_view(training.parse_jsonl(LOG))
    assert v["steps"] == 2 and v["last_step"] == 2
    curves = v["curves"]
    assert curves["reward"] == [[1, 0.3], [2, 0.5]]
    assert curves["heldout_accuracy"] == [[1, 0.2]]
    assert curves["staleness"] == [[2, 2.0]]
    assert curves["mismatch"] == []


def test_panels_have_labels_and_clip_kl_grad_norm_are_drawn_when_logged():
    """Issue 38.12: the page showed the log's keys (`heldout_accuracy`) as titles and no
    clip fraction, KL or gradient norm, which every step record carries."""
    v = training.training_view(training.parse_jsonl(LOG))
    assert v["labels"]["heldout_accuracy"] == "held-out accuracy"
    assert all(v["labels"][k] != k or k == "loss" for k in v["curves"])
    assert v["curves"]["clip_fraction"] == [[1, 0.1], [2, 0.2]]
    assert v["curves"]["kl"] == [[1, 0.02], [2, 0.03]]
    assert v["curves"]["grad_norm"] == [[1, 2.5], [2, 1.5]]
    # a log without them (another trainer's) gets no empty panels for them
    bare = training.training_view([{"type": "step", "step": 1, "loss": 1.0}])
    assert set(bare["curves"]) == {"reward", "heldout_accuracy", "loss", "staleness", "mismatch"}


def test_a_run_is_running_done_or_failed():
    records = training.parse_jsonl(LOG)
    assert training.training_view(records)["state"] == "running"
    done = training.training_view([*records, {"type": "done", "step": 2}])
    assert (done["state"], done["detail"]) == ("done", None)
    failed = training.training_view([*records, {"type": "error", "error": "mismatch 0.3"}])
    assert (failed["state"], failed["detail"]) == ("failed", "mismatch 0.3")
    # resumed after the failure: running again
    again = [*records, {"type": "error", "error": "x"}, {"type": "resume", "step": 2}]
    assert training.training_view(again)["state"] == "running"
    # the stack's trainer service says its run finished (its /healthz run check)
    service = {"ok": True, "done": True, "step": 2, "error": None}
    assert training.training_view(records, service)["state"] == "done"
    running = {"ok": True, "done": False, "step": 1, "error": None}
    assert training.training_view(records, running)["state"] == "running"
