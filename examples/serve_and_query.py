"""The OpenAI-compatible server in this process (needs `pip install 'mbd-rs[server]'`), queried over HTTP as any
OpenAI client would (`mbd-rs serve` runs the same app from the command line).

    python examples/serve_and_query.py
"""
import json
import socket
import threading
import time
import urllib.request

import uvicorn

from mbd_rs import Engine
from mbd_rs.server import create_app

with socket.socket() as s:  # a free port
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
app = create_app(Engine.load(), api_key="sk-local")
server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
threading.Thread(target=server.run, daemon=True).start()
while not server.started:
    time.sleep(0.05)

body = {"model": "mbd-tiny", "messages": [{"role": "user", "content": "sort 5 3 9 1"}], "block_size": 4}
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json", "Authorization": "Bearer sk-local"})
reply = json.load(urllib.request.urlopen(req, timeout=60))
print(reply["choices"][0]["message"]["content"], reply["usage"])
server.should_exit = True
