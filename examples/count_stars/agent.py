"""The count-stars agent (stdlib only): one image, one question, one protocol.

Sends ``stars.png`` (in its working directory) and the question in $POLAR_INSTRUCTION to
the model through $STARS_PROTOCOL (openai_chat, openai_responses, anthropic_messages or
gemini), each in that API's own image shape, at $POLAR_PROXY_URL (the session's proxy
route). Prints ``{"question": ..., "answer": ...}``. Polar runs it unmodified.
"""

import base64
import json
import os
import sys
import urllib.request

MAX_TOKENS = int(os.environ.get("STARS_MAX_TOKENS", "3"))
TEMPERATURE = float(os.environ.get("STARS_TEMPERATURE", "1.0"))


def openai_chat(image, question, model):
    url = "data:image/png;base64," + image
    body = {
        "model": model,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": question},
                ],
            }
        ],
        "max_tokens": MAX_TOKENS,
        "temperature": TEMPERATURE,
    }
    answer = post("/v1/chat/completions", body)
    return answer["choices"][0]["message"].get("content") or ""


def openai_responses(image, question, model):
    content = [
        {"type": "input_image", "image_url": "data:image/png;base64," + image},
        {"type": "input_text", "text": question},
    ]
    body = {
        "model": model,
        "input": [{"role": "user", "content": content}],
        "max_output_tokens": MAX_TOKENS,
        "temperature": TEMPERATURE,
    }
    answer = post("/v1/responses", body)
    return "".join(
        c.get("text", "")
        for item in answer["output"]
        if item.get("type") == "message"
        for c in item["content"]
    )


def anthropic_messages(image, question, model):
    source = {"type": "base64", "media_type": "image/png", "data": image}
    body = {
        "model": model,
        "max_tokens": MAX_TOKENS,
        "temperature": TEMPERATURE,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": source},
                    {"type": "text", "text": question},
                ],
            }
        ],
    }
    answer = post("/v1/messages", body)
    return "".join(b.get("text", "") for b in answer["content"] if b.get("type") == "text")


def gemini(image, question, model):
    parts = [{"inlineData": {"mimeType": "image/png", "data": image}}, {"text": question}]
    body = {
        "contents": [{"role": "user", "parts": parts}],
        "generationConfig": {"maxOutputTokens": MAX_TOKENS, "temperature": TEMPERATURE},
    }
    answer = post(f"/v1beta/models/{model}:generateContent", body)
    return "".join(p.get("text", "") for p in answer["candidates"][0]["content"]["parts"])


def post(path, body):
    req = urllib.request.Request(
        os.environ["POLAR_PROXY_URL"].rstrip("/") + path,
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},  # the token is in the route
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.load(resp)


PROTOCOLS = {f.__name__: f for f in (openai_chat, openai_responses, anthropic_messages, gemini)}


def main():
    with open("stars.png", "rb") as f:
        image = base64.b64encode(f.read()).decode()
    question = os.environ["POLAR_INSTRUCTION"].strip()
    ask = PROTOCOLS[os.environ.get("STARS_PROTOCOL", "openai_chat")]
    answer = ask(image, question, os.environ.get("POLAR_MODEL", "polar"))
    print(json.dumps({"question": question, "answer": answer}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
