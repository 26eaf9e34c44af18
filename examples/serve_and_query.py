"""Serve a model with ``zeal serve`` and query it with the ``openai`` client.

    python examples/serve_and_query.py               # starts `zeal serve` (SmolLM2-135M-Instruct), asks, stops it
    python examples/serve_and_query.py --model runs/example-smollm2   # serve your fine-tuned folder instead
    python examples/serve_and_query.py --base-url http://127.0.0.1:8000/v1   # ask a server you started yourself
    python examples/serve_and_query.py --toy         # short answers (what CI runs)

The server is OpenAI-compatible: ``model`` in a request must be the served name that
``/v1/models`` lists (the model folder's name, or ``--served-model-name``); any other
name is a 404. The same request with curl::

    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi!"}]}'

Needs ``pip install 'zeal[serve]' openai``.
"""
import argparse
import socket
import subprocess
import sys
import time
import urllib.request

from openai import OpenAI

parser = argparse.ArgumentParser()
parser.add_argument("--model", help="folder or .gguf to serve (default: the embedded SmolLM2)")
parser.add_argument("--base-url", help="an already running server, e.g. http://127.0.0.1:8000/v1")
parser.add_argument("--toy", action="store_true", help="8-token answers")
args = parser.parse_args()

server = None
base_url = args.base_url
if base_url is None:  # start `zeal serve` on a free port and wait until /health answers
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "zeal.cli.main", "serve", "--port", str(port), "--kv-cache-mb", "64",
           "--log-level", "warning"]
    server = subprocess.Popen(cmd + ([args.model] if args.model else []))
    base_url = f"http://127.0.0.1:{port}/v1"
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            break
        except OSError:
            if server.poll() is not None:
                sys.exit(f"zeal serve exited with status {server.returncode}")
            time.sleep(0.5)
    else:
        server.terminate()
        sys.exit("zeal serve did not answer /health within 5 minutes")

try:
    client = OpenAI(base_url=base_url, api_key="none")   # any key unless the server was given --api-key
    model = client.models.list().data[0].id
    print(f"served model name: {model}")
    tokens = 8 if args.toy else 64
    chat = client.chat.completions.create(
        model=model, max_tokens=tokens, temperature=0,
        messages=[{"role": "user", "content": "Write a Python function that reverses a string."}])
    print("chat:", chat.choices[0].message.content)
    print("usage:", chat.usage.prompt_tokens, "prompt +", chat.usage.completion_tokens, "completion tokens")
    print("stream: ", end="")
    for chunk in client.completions.create(model=model, prompt="def fibonacci(n):", max_tokens=tokens,
                                           temperature=0, stream=True):
        print(chunk.choices[0].text, end="", flush=True)
    print()
finally:
    if server is not None:
        server.terminate()
        server.wait(timeout=60)
