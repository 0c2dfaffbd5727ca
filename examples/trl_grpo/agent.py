"""A one-turn agent (stdlib only): asks $OPENAI_BASE_URL once with the task's
instruction, writes the answer to answer.txt. Polar runs it unmodified in a sandbox;
its one model call, made through Polar's proxy, is what TRL trains on."""

import json
import os
import urllib.request

body = {
    "model": os.environ.get("OPENAI_MODEL", "polar"),
    "messages": [{"role": "user", "content": os.environ["POLAR_INSTRUCTION"]}],
    "max_tokens": int(os.environ.get("ANSWER_TOKENS", "8")),
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
    answer = json.load(resp)["choices"][0]["message"].get("content") or ""
with open("answer.txt", "w", encoding="utf-8") as f:
    f.write(answer)
