"""A quiz agent (stdlib only): asks every line of its instruction as its own question.

Each non-empty line of $POLAR_INSTRUCTION is one question. The agent asks them all at
once, each as a one-turn OpenAI Chat Completions call to $OPENAI_BASE_URL (threads, so a
batching engine serves them together), and prints one JSON line per question:
``{"question": ..., "answer": ...}``. Optional settings: $QUIZ_TEMPERATURE (default 1.0),
$QUIZ_MAX_TOKENS (4), $QUIZ_CONCURRENCY (all questions at once). Polar runs it unmodified.
"""

import json
import os
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor


def ask(question):
    body = {
        "model": os.environ.get("OPENAI_MODEL", "polar"),
        "messages": [{"role": "user", "content": question}],
        "max_tokens": int(os.environ.get("QUIZ_MAX_TOKENS", "4")),
        "temperature": float(os.environ.get("QUIZ_TEMPERATURE", "1.0")),
    }
    req = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
        data=json.dumps(body).encode(),
        headers={
            "content-type": "application/json",
            "authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
        },
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.load(resp)["choices"][0]["message"].get("content") or ""


def main():
    questions = [q for q in os.environ["POLAR_INSTRUCTION"].splitlines() if q.strip()]
    workers = int(os.environ.get("QUIZ_CONCURRENCY", "0")) or len(questions) or 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        answers = list(pool.map(ask, questions))
    for question, answer in zip(questions, answers, strict=True):
        print(json.dumps({"question": question, "answer": answer}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
