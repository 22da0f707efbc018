"""`tandem serve` against what clients outside the project send: the requests of real clients (Ollama's Python
client's empty fields, llama-server's and Ollama's seed -1) and hostile ones (lone surrogates, unknown roles, wrong
methods). One server for the module, test_server.py's fixture."""

from __future__ import annotations

import json
import socket
import time

import pytest
import test_server
from test_server import CHAT, Running

from tandem.server import app, protocol

server = test_server.server  # this module's own instance of the fixture


def _post(server: Running, path: str, body: bytes | dict[str, object]) -> tuple[int, object]:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with server.http() as http:
        r = http.post(path, content=content, headers={"Content-Type": "application/json"})
    return r.status_code, r.json()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/show", b'{"model": "x\\ud800"}'),  # the name is echoed in the 404's message
        ("/v1/completions", b'{"prompt": "x \\udfff\\ud800", "max_tokens": 1}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 1}'),
        ("/api/chat", b'{"messages": [{"role": "user", "content": "hi"}], "options": {"stop": ["\\udc00"]}}'),
    ],
)
def test_lone_surrogates_are_400(server: Running, path: str, body: bytes) -> None:
    """A lone surrogate escape is no Unicode text: a 400 in the endpoint's error shape, not a 500 when an error
    message quotes it back (UTF-8 cannot encode it) nor a prompt of replacement characters."""
    status, error = _post(server, path, body)
    assert status == 400, error
    assert isinstance(error, dict)
    message = error["error"] if path.startswith("/api/") else error["error"]["message"]
    assert "lone surrogate" in message


def test_surrogate_pairs_are_text() -> None:
    """What clients that escape every non-ASCII character send (Python's json.dumps): pairs are one character."""
    body = protocol.parse_json(b'{"prompt": "\\ud83d\\ude00 \\\\ud800"}')
    assert body["prompt"] == "\U0001f600 \\ud800"


def test_ollama_python_client_empty_fields(server: Running) -> None:
    """Ollama's Python client (up to 0.3) sends every field, unset ones empty: `"format": ""`, `"template": ""`,
    `"suffix": ""`, `"system": ""`, `"context": []`, `"images": []`, as Ollama takes for "none"."""
    options = {"num_predict": 2, "temperature": 0}
    chat = {"model": "m", "messages": CHAT, "tools": [], "stream": False, "format": "", "options": options,
            "keep_alive": None}  # fmt: skip
    status, body = _post(server, "/api/chat", chat)
    assert status == 200 and body["done"] and body["eval_count"] == 2, body  # type: ignore[index]
    generate = {"model": "m", "prompt": "Hi", "suffix": "", "system": "", "template": "", "context": [],
                "stream": False, "raw": False, "images": [], "format": "", "options": options}  # fmt: skip
    status, body = _post(server, "/api/generate", generate)
    assert status == 200 and body["done"] and body["eval_count"] == 2, body  # type: ignore[index]
    status, body = _post(server, "/v1/completions", {"prompt": "Hi", "suffix": "", "max_tokens": 1})
    assert status == 200, body
    for path, field in (("/api/chat", "format"), ("/api/generate", "template"), ("/v1/completions", "suffix")):
        request = chat if path == "/api/chat" else generate if path == "/api/generate" else {"prompt": "Hi"}
        status, _ = _post(server, path, {**request, field: "json"})
        assert status == 400  # a value asks for what tandem does not do, still refused by name


def test_seed_minus_one_is_random() -> None:
    """llama-server's and Ollama's seed -1 means a random seed (Ollama's default options send it), not the seed
    -1: every such request drew the same tokens."""
    assert protocol.openai_completion({"prompt": "x", "seed": -1}).sampling.seed is None
    assert protocol.openai_chat({"messages": CHAT, "seed": -1}).sampling.seed is None
    assert protocol.ollama_chat({"messages": CHAT, "options": {"seed": -1}}).sampling.seed is None
    assert protocol.openai_completion({"prompt": "x", "seed": -2}).sampling.seed == -2
    assert protocol.openai_completion({"prompt": "x", "seed": 0}).sampling.seed == 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat"])
def test_unknown_roles_are_400(server: Running, path: str) -> None:
    """A role outside OpenAI's is refused by name (the template would render "wizard" as a turn of its own); the
    others, developer and tool included, are taken."""
    messages = [{"role": "wizard", "content": "hi"}]
    status, error = _post(server, path, {"messages": messages, "max_tokens": 1, "stream": False})
    assert status == 400
    assert isinstance(error, dict)
    if path == "/api/chat":
        assert "messages[0].role" in error["error"]
    else:
        assert error["error"]["param"] == "messages[0].role"
    messages = [{"role": "developer", "content": "Be brief."}, *CHAT, {"role": "assistant", "content": "Red."},
                {"role": "tool", "content": "42"}]  # fmt: skip
    status, body = _post(server, path, {"messages": messages, "max_tokens": 1, "stream": False,
                                        "options": {"num_predict": 1}})  # fmt: skip
    assert status == 200, body


def test_wrong_method_names_the_allowed_one(server: Running) -> None:
    """A 405 carries `Allow` (HTTP requires it; clients and proxies read it), in the JSON error of either API."""
    with server.http() as http:
        r = http.get("/v1/chat/completions")
        assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["message"]
        r = http.post("/api/tags")
        assert r.status_code == 405 and r.headers["allow"] == "GET" and r.json()["error"]


def test_a_stalled_body_is_408(server: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that sends its headers and part of the body, then nothing, gets a 408 once the body timeout has
    passed (uvicorn has none of its own for a body: the connection and its handler would be held for ever)."""
    monkeypatch.setattr(app, "BODY_TIMEOUT_S", 1.0)
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + test_server.KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n"
                     b'{"prompt": ')  # fmt: skip
        start = time.monotonic()
        chunks = [sock.recv(65536)]
        waited = time.monotonic() - start
        while chunk := sock.recv(65536):  # the body may come in a segment of its own; the server then closes
            chunks.append(chunk)
    answer = b"".join(chunks).decode()
    assert answer.startswith("HTTP/1.1 408"), answer[:200]
    assert 0.9 < waited < 8
    assert "did not arrive within 1 s" in answer
    with server.http() as http:  # the server answers the next request as before
        assert http.get("/health").status_code == 200
