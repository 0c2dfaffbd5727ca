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


def test_a_held_out_accuracy_improves_only_past_the_best_so_far():
    state = ck.TrainerState(run_id="r")
    assert ck.improves(state, 0.0)  # the first evaluation is the best so far
    state.best_step, state.best_accuracy = 2, 0.5
    assert ck.improves(state, 0.51)
    assert not ck.improves(state, 0.5)  # a tie keeps the earlier step
    assert not ck.improves(state, 0.4)


def test_prune_keeps_the_best_step_and_best_names_it(tmp_path):
    for step in range(1, 6):
        ck.commit_checkpoint(tmp_path, ck.TrainerState(run_id="r", step=step), write)
    assert ck.best(tmp_path) is None  # no evaluation has named one
    state = ck.TrainerState(run_id="r", step=5, best_step=2, best_accuracy=0.7)
    ck.mark_best(tmp_path, state)
    ck.prune(tmp_path, keep=1, protect=(ck.step_name(2),))
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000002", "step-000005"]
    assert ck.best(tmp_path) == tmp_path / "step-000002"
    ck.mark_best(tmp_path, ck.TrainerState(run_id="r"))  # none yet: BEST left as it is
    assert ck.best(tmp_path) == tmp_path / "step-000002"


def test_a_new_best_unprotects_the_old_one_at_once(tmp_path):
    # keep 1: step 0 was kept as the best; step 3 is the newest and now better
    for step in (0, 3):
        ck.commit_checkpoint(tmp_path, ck.TrainerState(run_id="r", step=step), write)
    ck.mark_best(tmp_path, ck.TrainerState(run_id="r", step=0, best_step=0, best_accuracy=0.5))
    ck.prune(tmp_path, keep=1, protect=(ck.step_name(0),))
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000000", "step-000003"]
    better = ck.TrainerState(run_id="r", step=3, best_step=3, best_accuracy=0.75)
    ck.promote_best(tmp_path, better, keep=1)  # no checkpoint follows (the run's last eval)
    assert [p.name for p in tmp_path.glob("step-*")] == ["step-000003"]
    assert ck.best(tmp_path) == tmp_path / "step-000003"
