"""The agent the verl adapter's test runs in Polar's sandboxes (stdlib only): one chat
call to its base URL, the reply to answer.txt; ``$VERL_TEST_MODE`` makes a session go
wrong the way the test needs:

- ``ok``: the call, then exit 0;
- ``fail_second``: the group's second session (``$POLAR_SESSION_ID`` ends in -0001)
  exits 3 before any call (its session ends ERROR, nothing captured);
- ``hang``: the call, then sleeps past the agent timeout (TIMEOUT, the call kept);
- ``wait``: sleeps before any call (the test cancels the task meanwhile).
"""

import json
import os
import sys
import time
import urllib.request

mode = os.environ.get("VERL_TEST_MODE", "ok")
if mode == "fail_second" and os.environ["POLAR_SESSION_ID"].endswith("-0001"):
    print("this sandbox is broken today", file=sys.stderr)
    sys.exit(3)
if mode == "wait":
    time.sleep(60)

body = {
    "model": os.environ.get("OPENAI_MODEL", "polar"),
    "messages": [{"role": "user", "content": os.environ["POLAR_INSTRUCTION"]}],
    "max_tokens": 6,
    "temperature": 1.0,
}
req = urllib.request.Request(
    os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
    data=json.dumps(body).encode(),
    headers={
        "content-type": "application/json",
        "authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
    },
)
with urllib.request.urlopen(req, timeout=120) as resp:
    reply = json.load(resp)["choices"][0]["message"].get("content") or ""
with open("answer.txt", "w") as f:
    f.write(reply)
if mode == "hang":
    time.sleep(60)
