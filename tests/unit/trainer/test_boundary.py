"""The trainer is a client of the stack: it shares the engine's model math and the
trajectory client, and reaches the proxy only over HTTP, the scheduler only over NATS."""

from tests.unit.engine.test_boundary import imports_of


def test_the_trainer_imports_nothing_from_the_proxy_or_the_cli():
    assert imports_of("services.trainer", "proxy") == []
    assert imports_of("services.trainer", "services.cli") == []


def test_no_service_imports_the_trainer():
    for package in ("proxy", "services.engine", "services.client", "services.scheduler"):
        assert imports_of(package, "services.trainer") == []
