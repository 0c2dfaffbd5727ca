from services.trainer import checkpoint as ck


def write(d):
    (d / "model.safetensors").write_bytes(b"w")


def test_latest_is_none_before_any_checkpoint(tmp_path):
    assert ck.latest(tmp_path) is None


def test_a_committed_step_is_latest_with_its_state(tmp_path):
    state = ck.TrainerState(
        run_id="r", step=3, trained=["r-t0", "r-t1"], in_flight={"r-t2": "train"}
    )
    path = ck.commit_checkpoint(tmp_path, state, write)
    assert path.name == "step-000003" and (path / "model.safetensors").exists()
    found, got = ck.latest(tmp_path)
    assert found == path and got == state


def test_a_crash_mid_write_leaves_the_previous_checkpoint_latest(tmp_path):
    ck.commit_checkpoint(tmp_path, ck.TrainerState(run_id="r", step=1), write)

    def dies(d):
        write(d)
        raise KeyboardInterrupt  # the process dies while writing step 2

    try:
        ck.commit_checkpoint(tmp_path, ck.TrainerState(run_id="r", step=2), dies)
    except KeyboardInterrupt:
        pass
    found, state = ck.latest(tmp_path)
    assert found.name == "step-000001" and state.step == 1
    assert not (tmp_path / "step-000002").exists()
    ck.prune(tmp_path, keep=3)  # the half-written temporary goes
    assert not list(tmp_path.glob(".tmp-*"))


def test_prune_keeps_the_newest(tmp_path):
    for step in range(1, 6):
        ck.commit_checkpoint(tmp_path, ck.TrainerState(run_id="r", step=step), write)
    ck.prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000004", "step-000005"]


def test_a_log_line_cut_by_a_crash_is_skipped(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text('{"type": "step", "step": 1}\n{"type": "st')
    assert ck.read_log(log) == [{"type": "step", "step": 1}]
