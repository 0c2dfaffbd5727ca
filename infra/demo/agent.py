"""A minimal tool-using shell agent (stdlib only): what a team's own harness looks like.

It talks OpenAI Chat Completions to $OPENAI_BASE_URL with $OPENAI_API_KEY, runs every
`bash` tool call it is asked for in the current directory, feeds the output back, and
stops when the model answers without a tool call. Polar runs it unmodified.
"""

import json
import os
import subprocess
import sys
import urllib.request

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command in the repository and return its output.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]


def chat(messages):
    body = json.dumps(
        {
            "model": os.environ.get("OPENAI_MODEL", "polar"),
            "messages": messages,
            "tools": TOOLS,
            "max_tokens": 256,
        }
    ).encode()
    req = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
        data=body,
        headers={
            "content-type": "application/json",
            "authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
        },
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.load(resp)["choices"][0]["message"]


def main(max_turns: int = 12) -> int:
    messages = [
        {"role": "system", "content": "You are a careful coding agent. Use the bash tool."},
        {"role": "user", "content": os.environ["POLAR_INSTRUCTION"]},
    ]
    for _ in range(max_turns):
        message = chat(messages)
        messages.append(message)
        calls = message.get("tool_calls") or []
        if not calls:
            print(message.get("content") or "")
            return 0
        for call in calls:
            command = json.loads(call["function"]["arguments"]).get("command", "")
            print(f"$ {command}", flush=True)
            done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=120)
            output = (done.stdout + done.stderr)[-4000:]
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})
    print("gave up after", max_turns, "turns", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
