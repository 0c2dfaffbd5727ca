"""Debian's headless chromium driven by selenium: the dashboard's browser tests and its
benchmark (`just setup` installs chromium and chromium-driver as root)."""

from __future__ import annotations

import shutil

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")


def new_browser():
    """A headless chromium; the caller quits it."""
    from selenium import webdriver

    if not (CHROMIUM and DRIVER):
        raise RuntimeError("needs chromium and chromium-driver (apt-get install -y ...)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--window-size=1400,1000",
        "--disable-dev-shm-usage",
    ):
        opts.add_argument(arg)
    service = webdriver.ChromeService(executable_path=DRIVER)
    return webdriver.Chrome(options=opts, service=service)


def printed_sign_in_url(topology) -> str:
    """The one-time sign-in link `polar dashboard` prints for the stack of ``topology`` (a
    topology file whose stack runs)."""
    import re

    from tests.helpers.polar_cli import run_polar

    done = run_polar("dashboard", "--topology", str(topology), timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    found = re.search(r"(http://\S+/\?token=\S+)", done.stdout)
    assert found, done.stdout
    return found[1]


def minted_sign_in_url(url: str, read_token: str) -> str:
    """The link `polar dashboard` would print for a dashboard holding ``read_token`` (for
    one a test started itself, with no stack record for the CLI to read)."""
    import time

    from services.common.auth import sign_in_ticket

    return f"{url}/?token={sign_in_ticket(read_token, 'dashboard', now=time.time())}"
