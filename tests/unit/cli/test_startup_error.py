"""infra.devstack.startup_error: a service's own reason, out of its log."""

from infra import devstack


def test_startup_error_finds_the_services_own_exception_line():
    granian_asgi = (
        "[INFO] Spawning worker-1 with PID: 7\nTraceback (most recent call last):\n"
        '  File "x.py", line 1, in create_app\n'
        "services.common.settings.ConfigError: SchedulerConfig: unknown field `x`\n"
        "[ERROR] Unexpected exit from worker-1\n"
    )
    assert devstack.startup_error(granian_asgi) == (
        "services.common.settings.ConfigError: SchedulerConfig: unknown field `x`"
    )
    group = (
        "lifespan startup failed:\n  + Exception Group Traceback (most recent call last):\n"
        "  | ExceptionGroup: unhandled errors in a TaskGroup (1 sub-exception)\n"
        "    | Traceback (most recent call last):\n"
        "    | ValueError: token mode needs the model's tokenizer (model_dir)\n"
        "    +------------------------------------\n[ERROR] Unexpected exit from worker-1\n"
    )
    assert devstack.startup_error(group) == (
        "ValueError: token mode needs the model's tokenizer (model_dir)"
    )
    assert devstack.startup_error("[ERROR] Unexpected exit from worker-1\n") is None
