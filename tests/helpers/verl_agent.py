"""The agent the verl adapter's test runs in Polar's sandboxes (stdlib only): the trainer
tests' agent (uploaded beside it as chat_agent.py: one chat call, the reply to
answer.txt), made to go wrong the way the test needs by ``$VERL_TEST_MODE``:

- ``ok``: the call, then exit 0;
- ``fail_second``: the group's second session (``$POLAR_SESSION_ID`` ends in -0001)
  exits 3 before any call (its session ends ERROR, nothing captured);
- ``hang``: the call, then sleeps past the agent timeout (TIMEOUT, the call kept);
- ``wait``: sleeps before any call (the test cancels the task meanwhile).
"""

import os
import runpy
import sys
import time

mode = os.environ.get("VERL_TEST_MODE", "ok")
if mode == "fail_second" and os.environ["POLAR_SESSION_ID"].endswith("-0001"):
    print("this sandbox is broken today", file=sys.stderr)
    sys.exit(3)
if mode == "wait":
    time.sleep(60)
runpy.run_path("chat_agent.py")
if mode == "hang":
    time.sleep(60)
