"""SIGTERM while requests are in flight: each gets a final error event (streams) or an error
response (non-streaming) that says the server is shutting down, and the server exits cleanly."""
import json
import signal
import threading
import time

import httpx

from server_fixture import MODEL, Server


def test_sigterm_ends_requests_in_flight_with_an_error():
    srv = Server("--max-batch", "1", "--max-queue", "4")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count forever."}], "max_tokens": 60000,
            "ignore_eos": True, "temperature": 0}
    lines, waiting = [], {}
    started = threading.Event()

    def stream():
        with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
            for ln in r.iter_lines():
                if ln.startswith("data: ") and '"content"' in ln:
                    started.set()
                lines.append(ln)

    def queued():  # waits for the one slot behind the stream
        waiting["r"] = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120)

    try:
        t1 = threading.Thread(target=stream)
        t1.start()
        assert started.wait(120)
        t2 = threading.Thread(target=queued)
        t2.start()
        for _ in range(600):  # the second request is in the server's queue before the signal
            if "freetoken_queue_depth 1.0" in httpx.get(srv.url + "/metrics", timeout=10).text:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the second request never reached the queue")
        srv.proc.send_signal(signal.SIGTERM)
        t1.join(60)
        t2.join(60)
        assert srv.proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it caught
    finally:
        out = srv.output()
        srv.stop()
    events = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
    assert events and "shutting down" in events[-1]["error"]["message"], lines[-3:]
    r = waiting["r"]
    assert r.status_code in (500, 503) and "shutting down" in r.json()["error"]["message"], r.text
    assert "Traceback" not in out, out[-2000:]
