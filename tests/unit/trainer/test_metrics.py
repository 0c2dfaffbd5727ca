from services.trainer import metrics


def step(n: int, **over) -> dict:
    rec = {
        "type": "step",
        "step": n,
        "reward_mean": 0.1 * n,
        "loss": 0.5,
        "clip_fraction": 0.0,
        "kl": 0.0,
        "mismatch_max": 1e-6,
        "mismatch_threshold": 1e-4,
        "rollout_wait_s": 1.0,
        "train_s": 0.2,
        "checkpoint_s": 0.1,
        "sync_s": 0.01,
    }
    return {**rec, **over}


def test_the_plot_takes_restored_and_repeated_records(tmp_path):
    restored = {k: v for k, v in step(2).items() if k not in ("checkpoint_s", "sync_s")}
    records = [
        {"type": "eval", "step": 0, "accuracy": 0.1},
        step(1),
        {**restored, "restored": True},  # a step the checkpoint held and the log lost
        {"type": "resume", "step": 2},
        {"type": "eval", "step": 2, "accuracy": 0.3},
        {"type": "eval", "step": 2, "accuracy": 0.4},  # redone after a restart
        step(3, mismatch_max=None),  # no on-policy token this step
    ]
    out = metrics.plot(records, tmp_path / "p.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_the_log_appends_one_json_object_per_line(tmp_path):
    log = tmp_path / "d" / "log.jsonl"
    metrics.append_log(log, [step(1)])
    metrics.append_log(log, [step(2), {"type": "eval", "step": 2, "accuracy": 0.5}])
    from services.trainer.checkpoint import read_log

    assert [r["step"] for r in read_log(log)] == [1, 2, 2]
