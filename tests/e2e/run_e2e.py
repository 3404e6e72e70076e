"""Starts `deltafin serve` on a free 127.0.0.1 port, runs a test suite against it, always stops it.

    python3 tests/e2e/run_e2e.py --bin target/debug/deltafin --model tests/fixtures/k3/k3-tiny-a \
        [--suite tests/e2e/test_openai_client.py]

The server is asked for port 0 and the port it got is read from its log. After the tests it must shut down
cleanly on SIGTERM (graceful shutdown); if it does not within a few seconds it is killed and the run fails.
Exit status: 0 when the tests pass and the server stopped cleanly.
"""

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
START_TIMEOUT_S = 60
SUITE_TIMEOUT_S = 600
STOP_TIMEOUT_S = 10


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True, help="the deltafin binary")
    ap.add_argument("--model", required=True, help="model directory (a fixture)")
    ap.add_argument("--model-id", default="k3-tiny-a")
    ap.add_argument("--suite", default=os.path.join(HERE, "test_openai_client.py"), help="the tests to run")
    args = ap.parse_args()

    cmd = [
        args.bin, "serve", "--model", args.model, "--host", "127.0.0.1", "--port", "0",
        "--served-model-name", args.model_id, "--keep-alive-secs", "1", "--max-queue", "2",
    ]
    print("starting:", " ".join(cmd), flush=True)
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    addr = {}
    found = threading.Event()

    def pump():
        # Echo the server log (prefixed) and pick up the address it listens on.
        for line in server.stderr:
            sys.stderr.write("  [server] " + line)
            m = re.search(r"listening on http://([0-9.]+:[0-9]+)/v1", line)
            if m and not found.is_set():
                addr["addr"] = m.group(1)
                found.set()
        found.set()

    threading.Thread(target=pump, daemon=True).start()
    failed = True
    try:
        if not found.wait(START_TIMEOUT_S) or "addr" not in addr:
            print(f"server did not report its address within {START_TIMEOUT_S} s", flush=True)
            return 1
        base = f"http://{addr['addr']}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                print("server never became healthy", flush=True)
                return 1
            time.sleep(0.1)
        env = dict(os.environ)
        env.update({
            "OPENAI_BASE_URL": base + "/v1",
            "DELTAFIN_E2E_MODEL_ID": args.model_id,
            "DELTAFIN_E2E_MODEL_DIR": args.model,
            "DELTAFIN_BIN": args.bin,
            "PYTHONUNBUFFERED": "1",
        })
        try:
            tests = subprocess.run([sys.executable, args.suite], env=env,
                                   timeout=SUITE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(f"e2e suite exceeded {SUITE_TIMEOUT_S} s", flush=True)
            return 1
        failed = tests.returncode != 0
    finally:
        stopped_cleanly = stop(server)
    if not stopped_cleanly:
        print("server did not shut down cleanly on SIGTERM", flush=True)
        return 1
    return 1 if failed else 0


def stop(server):
    """SIGTERM, then SIGKILL to the whole group after a grace period. True if it exited 0 on SIGTERM."""
    if server.poll() is not None:
        return False
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(STOP_TIMEOUT_S)
        return server.returncode == 0
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        return False


if __name__ == "__main__":
    sys.exit(main())
