"""Anthropic Python SDK against `ds4mlx serve`: streamed thinking + text, token count.

pip install anthropic && python examples/anthropic_sdk.py
"""

import os

import anthropic

client = anthropic.Anthropic(
    base_url=os.environ.get("DS4MLX_URL", "http://127.0.0.1:8000"),
    api_key=os.environ.get("DS4MLX_API_KEY", "local"),
)
messages = [{"role": "user", "content": "Explain KV caches in two sentences."}]

print(
    "prompt tokens:",
    client.messages.count_tokens(model="deepseek-v4-flash", messages=messages).input_tokens,
)

with client.messages.stream(model="deepseek-v4-flash", max_tokens=120, messages=messages) as stream:
    for event in stream:
        if event.type == "content_block_delta" and event.delta.type == "thinking_delta":
            print(f"\033[2m{event.delta.thinking}\033[0m", end="", flush=True)
        elif event.type == "content_block_delta" and event.delta.type == "text_delta":
            print(event.delta.text, end="", flush=True)
    final = stream.get_final_message()
print()
print(
    "stop:",
    final.stop_reason,
    "usage:",
    final.usage.input_tokens,
    "+",
    final.usage.output_tokens,
    "cached:",
    final.usage.cache_read_input_tokens,
)

# Thinking off for one request.
m = client.messages.create(
    model="deepseek-v4-flash",
    max_tokens=30,
    thinking={"type": "disabled"},
    messages=[{"role": "user", "content": "Say hi."}],
)
print([b.type for b in m.content], m.content[-1].text if m.content else "")
