"""Rerunning the same `polar train` command (issue 38's must-show): it says where it goes on
from, and a stack gone at the run's end does not turn a finished run into a failure."""

import asyncio

from services.trainer.cli import _print, resume_line
from services.trainer.loop import Trainer


def test_a_rerun_says_which_checkpoint_it_resumed_from(capsys):
    rec = {"type": "resume", "step": 7, "checkpoint": "step-000007", "trained_groups": 14,
           "in_flight": 2, "time": 0.0}  # fmt: skip
    _print(rec)
    assert capsys.readouterr().out == (
        "resumed from step-000007 (step 7, 14 groups trained, 2 groups still in flight)\n"
    )
    assert resume_line({**rec, "in_flight": 0}).endswith("14 groups trained)")


class _Gone:
    """A connection to a stack that was stopped under the run: closing it fails."""

    def __init__(self) -> None:
        self.closed = 0

    async def close(self, **_) -> None:
        self.closed += 1
        raise ConnectionResetError("Connection lost")

    async def aclose(self) -> None:
        await self.close()

    async def delete_consumer(self) -> None:
        raise ConnectionResetError("Connection lost")

    async def stop(self) -> None:
        raise ConnectionResetError("Connection lost")


def test_closing_after_the_stack_went_down_tries_every_connection_and_raises_nothing(caplog):
    async def close() -> Trainer:
        trainer = Trainer.__new__(Trainer)
        trainer.reader = asyncio.create_task(asyncio.sleep(60))
        trainer.cfg = type("Cfg", (), {"cancel_on_exit": False})()
        trainer.done = True
        trainer.client, trainer.bus, trainer.http, trainer.submitter = (
            _Gone(), _Gone(), _Gone(), _Gone()
        )  # fmt: skip
        await trainer._close()
        return trainer

    trainer = asyncio.run(close())
    assert (trainer.client.closed, trainer.bus.closed, trainer.http.closed) == (1, 1, 1)
    assert caplog.text.count("closing the trainer's connections: ConnectionResetError") == 3


def test_ctrl_c_names_the_checkpoint_the_same_command_resumes_from(tmp_path):
    import msgspec

    from services.trainer import checkpoint as ck
    from services.trainer.cli import interrupted_line

    cfg = type("Cfg", (), {"checkpoint_dir": str(tmp_path), "steps": 8})()
    assert "before the first checkpoint" in interrupted_line(cfg)
    (tmp_path / "step-000002").mkdir()
    state = ck.TrainerState(run_id="r", step=2)
    (tmp_path / "step-000002" / ck.STATE_FILE).write_bytes(msgspec.json.encode(state))
    (tmp_path / ck.LATEST).write_text("step-000002")
    assert interrupted_line(cfg) == (
        "interrupted; the last checkpoint is step-000002 (step 2 of 8): the same command "
        "resumes from it"
    )
