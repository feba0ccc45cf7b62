"""A small OpenAI-compatible chat server for the `cupy-dsa needle` tests (stdlib http.server in a thread, on
127.0.0.1; nothing leaves the machine).

It counts tokens as words and punctuation marks (+3 per message, +2 per request) and "reads" only the last
``window`` tokens of the prompt: it answers the needle's number when the needle sentence lies in them, so recall
falls as the context grows past the window, the further from the end the faster. Faults can be switched on: HTTP
errors for the first requests, a delay, an API key, no usage, no model listing, answers cut off by max_tokens, a
server that dies after a number of chat requests, and a residue defect: prompts whose length is a given residue mod
4 get the needle's last digit wrong (as vLLM #55927 reports of DeepSeek-V4-Flash at length 3 mod 4).

Run on its own it is a stand-in server to try `cupy-dsa needle` without a GPU or a model (it prints its URL and
serves until interrupted)::

    python tests/needle_server.py --port 30001 &
    cupy-dsa needle --base-url http://127.0.0.1:30001/v1 --lengths 256,512,1K --depths 0,0.5,1 --trials 2
"""
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN = re.compile(r"\w+|[^\w\s]")


def count_tokens(messages) -> int:
    return 2 + sum(3 + len(TOKEN.findall(m.get("content") or "")) for m in messages)


class FakeServer:
    """An OpenAI-compatible chat server with a fixed reading rule and switchable faults."""

    def __init__(self, *, window=300, models=("fake-dsv4",), max_model_len=1 << 20, list_models=True,
                 list_max_len=True, fail=0, fail_status=500, delay=0.0, api_key=None, usage=True, reasons=0,
                 residue_defect=None, die_after=None, port=0):
        self.window, self.models, self.max_model_len = window, list(models), max_model_len
        self.list_models, self.list_max_len = list_models, list_max_len
        self.fail, self.fail_status, self.delay, self.api_key, self.usage = fail, fail_status, delay, api_key, usage
        self.reasons = reasons  # tokens of "reasoning" before the answer: max_tokens below it cuts the answer off
        self.residue_defect = residue_defect  # None, or the prompt length mod 4 whose answers get the last digit wrong
        self.die_after = die_after    # None, or the number of chat requests answered before every request fails
        self.requests = []            # chat request bodies, in arrival order
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status, body, headers=()):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in headers:
                    self.send_header(k, v)
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def _error(self, status, message, headers=()):
                self._send(status, {"error": {"message": message, "type": "invalid_request_error", "code": status}},
                           headers)

            def _authorized(self):
                if outer.api_key is None:
                    return True
                if self.headers.get("Authorization") == f"Bearer {outer.api_key}":
                    return True
                self._error(401, "Invalid API key")
                return False

            def do_GET(self):
                if not self._authorized():
                    return
                if self.path.rstrip("/") != "/v1/models" or not outer.list_models:
                    return self._error(404, f"Not Found: {self.path}")
                cards = [{"id": m, "object": "model", "created": 0, "owned_by": "test",
                          **({"max_model_len": outer.max_model_len} if outer.list_max_len else {})}
                         for m in outer.models]
                self._send(200, {"object": "list", "data": cards})

            def do_POST(self):
                if not self._authorized():
                    return
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if self.path.rstrip("/") != "/v1/chat/completions":
                    return self._error(404, f"Not Found: {self.path}")
                with outer.lock:
                    outer.requests.append(body)
                    failing = outer.fail > 0
                    if failing:
                        outer.fail -= 1
                    dead = outer.die_after is not None and len(outer.requests) > outer.die_after
                if outer.delay:
                    time.sleep(outer.delay)
                if failing:
                    return self._error(outer.fail_status, "the server had a hiccup", [("retry-after-ms", "10")])
                if dead:
                    return self._error(503, "the server is down", [("retry-after-ms", "10")])
                if body.get("model") not in outer.models:
                    return self._error(404, f"The model `{body.get('model')}` does not exist.")
                prompt_tokens = count_tokens(body["messages"])
                if prompt_tokens >= outer.max_model_len:
                    return self._error(400, f"The input ({prompt_tokens} tokens) is longer than the model's context "
                                            f"length ({outer.max_model_len} tokens).")
                answer, finish = outer.answer(body["messages"][-1]["content"], prompt_tokens), "stop"
                if body.get("max_tokens", 1 << 30) <= outer.reasons:
                    answer, finish = "Let me think about where the secret", "length"
                resp = {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                        "choices": [{"index": 0, "finish_reason": finish,
                                     "message": {"role": "assistant", "content": answer}}]}
                if outer.usage:
                    resp["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": 5,
                                     "total_tokens": prompt_tokens + 5}
                self._send(200, resp)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def answer(self, content: str, prompt_tokens: int = 0) -> str:
        """The fixed rule: the needle's number if the needle sentence is in the last ``window`` tokens; with the
        residue defect on, its last digit is off by one when the prompt's length is that residue mod 4."""
        tail = " ".join(TOKEN.findall(content)[-self.window:])
        m = re.search(r"secret number of the \w+ \w+ is (\d+)", tail)
        if not m:
            return "I cannot find a secret number."
        number = m.group(1)
        if self.residue_defect is not None and prompt_tokens % 4 == self.residue_defect:
            number = number[:-1] + str((int(number[-1]) + 1) % 10)
        return f"The secret number is {number}."

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="A stand-in OpenAI-compatible server for `cupy-dsa needle` (127.0.0.1): "
                                             "it reads only the last --window tokens of each prompt.")
    ap.add_argument("--port", type=int, default=30001, help="port on 127.0.0.1 (0: any free one) [default: 30001]")
    ap.add_argument("--window", type=int, default=300, help="tokens it reads from the end [default: 300]")
    ap.add_argument("--residue-defect", type=int, choices=range(4), default=None,
                    help="answer the needle's last digit wrong when the prompt length is this residue mod 4")
    args = ap.parse_args(argv)
    with FakeServer(window=args.window, residue_defect=args.residue_defect, port=args.port) as srv:
        print(f"needle stand-in server at {srv.url} (model {srv.models[0]}, reads the last {srv.window} tokens); "
              "Ctrl-C stops it", flush=True)
        try:
            srv.thread.join()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
