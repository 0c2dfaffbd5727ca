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
