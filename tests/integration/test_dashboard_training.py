"""The training page against a real trainer: the trainer service runs a few steps on the
tiny model through the whole stack (as tests/integration/test_trainer.py runs it) while
a headless chromium follows /training, which must draw the reward, held-out accuracy,
loss, staleness and logprob-mismatch curves by step and grow them live, step by step,
without a reload.

``POLAR_DASHBOARD_SHOTS=docs/img`` saves the page as dashboard-training.png.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from infra import devstack
from infra.stackstate import Proc, read_state, write_state
from infra.topology import parse_topology
from services.trainer import checkpoint as ck
from tests.helpers.browser import new_browser, printed_sign_in_url
from tests.helpers.procs import ServiceProcess
from tests.helpers.trainer_stack import model_copy, topology_yaml, trainer_config
from tests.integration.test_dashboard_browser import By, goto, shot, wait

pytestmark = [pytest.mark.timeout(300)]
STEPS = 3


def curve(driver, name: str) -> int:
    """How many points the page draws for one curve."""
    fig = driver.find_element(By.CSS_SELECTOR, f'figure[data-curve="{name}"]')
    return len(fig.find_elements(By.CSS_SELECTOR, "circle.dot"))


def test_the_training_page_draws_a_live_trainers_curves_step_by_step():
    state_dir = Path(tempfile.mkdtemp(prefix="polar-dash-train-"))
    model_dir = model_copy(state_dir / "model")
    out = state_dir / "run"
    log = out / "ckpt" / "log.jsonl"
    # the dashboard reads the trainer's JSONL log, as `polar up` wires it (infra/wiring.py)
    yaml = re.sub(
        r"dashboard: \{port: (\d+)\}",
        lambda m: f"dashboard: {{port: {m[1]}, config: {{trainer_log: '{log}'}}}}",
        topology_yaml(state_dir, model_dir, max_run=4),
    )
    topo = parse_topology(yaml, "dashboard training test")
    devstack.up(topo)
    url = f"http://127.0.0.1:{topo.services['dashboard'].port}"
    driver = new_browser()
    trainer = None
    try:
        (state_dir / "topology.yaml").write_text(yaml)
        goto(driver, printed_sign_in_url(state_dir / "topology.yaml"))  # as an operator does
        goto(driver, url + "/training")
        wait(driver, lambda d: d.find_element(By.ID, "train-steps").text == "0 steps")
        loaded = driver.find_element(By.TAG_NAME, "body").get_attribute("data-rendered")
        cfg = trainer_config(
            topo,
            model_dir,
            "http://127.0.0.1:" + str(topo.services["proxy"].port),
            out,
            run_id="dash",
            steps=STEPS,
            groups_per_step=2,
            rollout_ahead=1,  # a group samples while the step before trains: stale
            eval={"at_start": True, "at_end": True, "every": 0},
        )
        t0 = time.monotonic()
        trainer = ServiceProcess("services.trainer.main:create_app", cfg, out).start(timeout=60)
        # the page, never reloaded, shows each step as the trainer logs it
        seen: list[str] = []
        for n in range(1, STEPS + 1):
            wait(driver, lambda d, n=n: curve(d, "loss") >= n, 180)
            seen.append(driver.find_element(By.ID, "train-steps").text)
        assert seen[0] != f"{STEPS} steps", "the first step was never shown on its own"
        wait(driver, lambda d: curve(d, "heldout_accuracy") == 2, 120)  # at start and at end
        print(f"trainer: {STEPS} steps and 2 evaluations in {time.monotonic() - t0:.1f} s")
        assert driver.find_element(By.TAG_NAME, "body").get_attribute("data-rendered") != loaded
        assert driver.execute_script("return performance.navigation.type") == 0  # no reload

        steps = [r for r in ck.read_log(log) if r["type"] == "step"]
        assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
        for name in ("reward", "loss", "staleness"):
            assert curve(driver, name) == STEPS, name
        # a stale sample is not checked against the engine: mismatch is by step where any was
        checked = [r for r in steps if r.get("mismatch_max") is not None]
        assert checked and curve(driver, "mismatch") == len(checked)
        caption = driver.find_element(By.CSS_SELECTOR, 'figure[data-curve="loss"] figcaption')
        assert f"at step {STEPS}" in caption.text
        # labelled panels, and the ones the trainer logs besides (issue 38.12)
        caption = driver.find_element(
            By.CSS_SELECTOR, 'figure[data-curve="heldout_accuracy"] figcaption'
        )
        assert caption.text.startswith("held-out accuracy: ")
        for name in ("clip_fraction", "kl", "grad_norm"):
            assert curve(driver, name) == STEPS, name
        # the stack's trainer service says its run is done (its /healthz): so does the page
        record = read_state(state_dir)
        assert record is not None
        service = Proc(
            name="trainer",
            pid=None,
            start_ticks=None,
            url=trainer.url,
            port=trainer.port,
            started=False,  # not ours to stop: `polar down` leaves it be
        )
        record.procs.append(service)
        write_state(record)
        wait(driver, lambda d: d.find_element(By.ID, "train-state").text == f"done at step {STEPS}")
        shot(driver, "training")
    finally:
        driver.quit()
        if trainer is not None:
            trainer.stop()
        devstack.down(state_dir)
        shutil.rmtree(state_dir, ignore_errors=True)
