"""The chaos test's agent: a few chat calls through the session's proxy route, each with
the conversation so far, retried while the stack is faulty (a killed proxy or model, the
registry down: connection errors, 5xx, 429) as coding-agent CLIs retry. A 4xx is final:
the session is over (its token died) or the request is wrong. Stdlib only."""

import json
import os
import sys
import time
import urllib.error
import urllib.request

CALLS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
# per call: longer than any one fault lasts (the test sets it past its longest outage)
RETRY_FOR_S = float(os.environ.get("CHAOS_RETRY_S", "90"))


def call(messages: list[dict]) -> str:
    url = os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions"
    body = json.dumps({"model": "m", "max_tokens": 8, "messages": messages}).encode()
    headers = {"content-type": "application/json"}
    deadline = time.monotonic() + RETRY_FOR_S
    while True:
        try:
            req = urllib.request.Request(url, body, headers)
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.load(r)["choices"][0]["message"].get("content") or ""
        except urllib.error.HTTPError as e:
            if e.code < 500 and e.code != 429 or time.monotonic() > deadline:
                raise
        except OSError:  # refused, reset, timed out
            if time.monotonic() > deadline:
                raise
        time.sleep(0.3)


def main() -> None:
    messages = [{"role": "user", "content": "count the files"}]
    for i in range(CALLS):
        answer = call(messages)
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"and now step {i + 2}"},
        ]
        time.sleep(0.2)  # the agent's own work between calls
    print("done")


if __name__ == "__main__":
    main()
