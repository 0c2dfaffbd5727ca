"""The quarantine rule of the shared consumer (services/common/quarantine.py), as a table:
what delivery ``d`` of a message does, from what its earlier deliveries left."""

import pytest

from services.common.quarantine import QUARANTINE_AFTER, Record, judge

AFTER = 4


@pytest.mark.parametrize(
    ("delivered", "record", "last", "action", "deaths"),
    [
        (1, Record(), False, "run", 0),  # a first delivery
        (2, Record(naks=1), False, "run", 0),  # the first one was nakked: no death
        (2, Record(), False, "run", 1),  # one death: run as usual
        (3, Record(), False, "run", 2),
        (4, Record(), False, "alone", 3),  # after - 1 deaths: alone
        (6, Record(naks=2), False, "alone", 3),
        (5, Record(alone=4), False, "quarantine", 4),  # died while alone
        (7, Record(naks=1, died_alone=True), False, "quarantine", 5),  # its end failed
        (3, Record(naks=1), True, "quarantine", 1),  # last delivery after a death
        (3, Record(naks=2), True, "run", 0),  # last delivery, no death
        (6, Record(alone=4, hook=5), False, "dead", 5),  # ending the session died too
    ],
)
def test_what_a_delivery_does(delivered, record, last, action, deaths):
    verdict = judge(delivered, record, after=AFTER, last=last)
    assert (verdict.action, verdict.deaths) == (action, deaths)
    assert verdict.reason.startswith("quarantined: ") == (action in ("quarantine", "dead"))


def test_the_reason_counts_the_deaths():
    verdict = judge(5, Record(alone=4), after=AFTER, last=False)
    assert verdict.reason == (
        "quarantined: its process died 4 times while handling it, the last time running alone"
    )
    assert judge(2, Record(), after=AFTER, last=True).times == "once"


def test_three_kills_of_a_service_never_quarantine_a_message():
    # the chaos tests kill each service three times: good work in flight each time runs
    # alone next, and is not quarantined
    assert QUARANTINE_AFTER == AFTER
    assert judge(4, Record(), after=QUARANTINE_AFTER, last=False).action == "alone"


def test_a_process_knows_its_own_age_not_its_modules():
    """A suspect waits until its process is SUSPECT_AFTER_S old (granian's crash-loop
    window): the age is the process's own, so a fresh child is young."""
    import subprocess
    import sys

    from services.common.consumer import SUSPECT_AFTER_S, process_age

    assert process_age() > 0
    code = "from services.common.consumer import process_age; print(process_age())"
    child = float(subprocess.run([sys.executable, "-c", code], capture_output=True,
                                 text=True, check=True).stdout)  # fmt: skip
    assert 0 <= child < SUSPECT_AFTER_S * 10  # seconds, not the parent's age or the uptime
