"""The OpenAI Python SDK against a pool's own listener: a plain base_url, the pool key as a
default header. Prints one line per check for tests/it/sdk.rs to assert on."""
import sys

from openai import OpenAI

base_url, key = sys.argv[1], sys.argv[2]
client = OpenAI(
    base_url=base_url,
    api_key="not-used-nthbouncer-holds-the-origin-credential",
    default_headers={"X-Nthpool-Key": key},
    max_retries=0,
)
messages = [{"role": "user", "content": "hello from the sdk"}]

answer = client.chat.completions.create(model="demo", messages=messages)
print("sync", answer.choices[0].message.role, bool(answer.choices[0].message.content))

chunks = 0
text = ""
for chunk in client.chat.completions.create(model="demo", messages=messages, stream=True):
    chunks += 1
    if chunk.choices and chunk.choices[0].delta.content:
        text += chunk.choices[0].delta.content
print("stream", chunks, bool(text))
