"""OpenAI Python SDK against `ds4mlx serve`: chat (streamed, with a tool), Responses.

pip install openai && python examples/openai_sdk.py
"""

import json
import os

from openai import OpenAI

client = OpenAI(
    base_url=os.environ.get("DS4MLX_URL", "http://127.0.0.1:8000") + "/v1",
    api_key=os.environ.get("DS4MLX_API_KEY", "local"),
)

# Chat Completions, streamed. Thinking arrives as `reasoning_content` (DeepSeek's field).
stream = client.chat.completions.create(
    model="deepseek-v4-flash",
    messages=[{"role": "user", "content": "Write a haiku about caches."}],
    max_tokens=120,
    stream=True,
)
for chunk in stream:
    delta = chunk.choices[0].delta if chunk.choices else None
    if delta is None:
        continue
    reasoning = (delta.model_extra or {}).get("reasoning_content")
    if reasoning:
        print(f"\033[2m{reasoning}\033[0m", end="", flush=True)
    if delta.content:
        print(delta.content, end="", flush=True)
print()

# A tool the model may call (non-thinking mode via the deepseek-chat alias).
tools = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
r = client.chat.completions.create(
    model="deepseek-chat",
    messages=[{"role": "user", "content": "What's the weather in Paris?"}],
    tools=tools,
    max_tokens=60,
)
msg = r.choices[0].message
for call in msg.tool_calls or []:
    print("tool call:", call.function.name, json.loads(call.function.arguments))
print(
    "finish:",
    r.choices[0].finish_reason,
    "usage:",
    r.usage.prompt_tokens,
    "+",
    r.usage.completion_tokens,
)

# Responses API (what Codex uses).
resp = client.responses.create(
    model="deepseek-v4-flash", input="Say hello in French.", max_output_tokens=60
)
print("responses:", resp.status, repr(resp.output_text))
