"""A bounded soak of the OpenAI server (loopback only, stdlib HTTP): many concurrent streaming and non-streaming
greedy completions of different lengths, clients that vanish mid-stream, requests aborted by their client's
timeout, prompts that hit the prefix cache, a request that runs into max_model_len, and malformed requests.

`soak(base, model, jobs)` runs `jobs` (see `plan`) on a thread pool and returns, per job, what the client saw."""

from __future__ import annotations

import http.client
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse


def request(base: str, path: str, body, stream: bool = False, timeout: float = 300,
            drop_after: int | None = None) -> dict:
    """POST body (a dict, or raw bytes for malformed JSON). drop_after: close the connection after that many
    stream chunks (a client that vanishes). Returns {"status", "text", "chunks", "dropped", "error"}."""
    u = urlparse(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    data = body if isinstance(body, bytes) else json.dumps({**body, "stream": True} if stream else body).encode()
    out = {"status": None, "text": "", "chunks": 0, "dropped": False, "error": None, "finish_reason": None}
    try:
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        out["status"] = r.status
        if r.status != 200 or not stream:
            payload = r.read()
            try:
                doc = json.loads(payload)
            except ValueError:
                doc = {"raw": payload[:200].decode(errors="replace")}
            if r.status == 200:
                out["text"] = doc["choices"][0]["text"]
                out["finish_reason"] = doc["choices"][0]["finish_reason"]
            else:
                out["error"] = doc
            return out
        while True:
            line = r.readline()
            if not line:
                break
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            for c in chunk.get("choices", []):
                out["text"] += c.get("text", "")
                out["finish_reason"] = c.get("finish_reason") or out["finish_reason"]
            out["chunks"] += 1
            if drop_after is not None and out["chunks"] >= drop_after:
                out["dropped"] = True
                conn.sock.shutdown(socket.SHUT_RDWR)
                break
    except (socket.timeout, TimeoutError):
        out["error"] = "client timeout"
    finally:
        conn.close()
    return out


def run_jobs(base: str, jobs: list[dict], workers: int = 24) -> list[dict]:
    """Every job at once (up to `workers` in flight): {"path", "body", "stream", "timeout", "drop_after"}."""
    def one(job):
        t0 = time.perf_counter()
        res = request(base, job.get("path", "/v1/completions"), job["body"], job.get("stream", False),
                      job.get("timeout", 300), job.get("drop_after"))
        return {**res, "seconds": time.perf_counter() - t0}

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, jobs))


def scrape(base: str, prefix: str = "vllm:") -> dict:
    """/metrics samples whose name starts with prefix: {name{labels}: value}."""
    u = urlparse(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def total(samples: dict, name: str) -> float:
    return sum(v for k, v in samples.items() if k.split("{")[0] == name)
