"""The task's agent program (stdlib only), run unmodified by Polar's shell harness.

The shell harness starts ``agent.command`` in the session's sandbox with the model's
endpoint in its environment: ``OPENAI_BASE_URL`` (the proxy, per session),
``OPENAI_API_KEY`` (the session's token), ``OPENAI_MODEL`` (``agent.model``) and
``POLAR_INSTRUCTION`` (the task's instruction). Every call made there is captured and
becomes the session's trajectory. This agent asks once and writes the answer to
answer.txt, where the evaluator (score.py) reads it.
"""

import json
import os
import urllib.request


def ask(instruction: str) -> str:
    body = {
        "model": os.environ.get("OPENAI_MODEL", "tiny"),
        "messages": [{"role": "user", "content": instruction}],
        "max_tokens": int(os.environ.get("ANSWER_TOKENS", "12")),
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
        return json.load(resp)["choices"][0]["message"].get("content") or ""


if __name__ == "__main__":
    answer = ask(os.environ["POLAR_INSTRUCTION"])
    with open("answer.txt", "w", encoding="utf-8") as f:
        f.write(answer)
    print(f"answered {answer!r}")
