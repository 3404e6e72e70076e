"""End-to-end tests of `deltafin serve` with the official `openai` Python package.

Run by `tests/e2e/run_e2e.py`, which starts the server on a free 127.0.0.1 port with a fixture model and sets:

- OPENAI_BASE_URL: the server's /v1 URL
- DELTAFIN_E2E_MODEL_ID: the served model id
- DELTAFIN_E2E_MODEL_DIR: the model directory (for `deltafin run`, the reference answers)
- DELTAFIN_BIN: the `deltafin` binary

The fixture has random weights: the text is noise, but greedy answers are deterministic, which is what is
compared. Every request has a timeout and every loop a bound.
"""

import json
import os
import subprocess
import threading
import time
import unittest
import urllib.request

import jsonschema
import openai

BASE_URL = os.environ["OPENAI_BASE_URL"]
MODEL = os.environ["DELTAFIN_E2E_MODEL_ID"]
MODEL_DIR = os.environ["DELTAFIN_E2E_MODEL_DIR"]
DELTAFIN = os.environ["DELTAFIN_BIN"]

# Seconds any single request may take; the whole suite is bounded by the driver.
REQUEST_TIMEOUT = 60.0


def client(**kwargs):
    """A client that never retries on its own (so a 429 is seen as a 429)."""
    return openai.OpenAI(
        base_url=BASE_URL, api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT, **kwargs
    )


def extra(obj, name, default=None):
    """A field the SDK's types do not declare (reasoning_content, token_ids, ...)."""
    value = getattr(obj, name, None)
    if value is None and getattr(obj, "model_extra", None):
        value = obj.model_extra.get(name)
    return default if value is None else value


ROOT_URL = BASE_URL.rsplit("/v1", 1)[0]


def health():
    with urllib.request.urlopen(ROOT_URL + "/health", timeout=10) as r:
        return json.load(r)


def metrics():
    """`GET /metrics` as {sample name with labels: value}."""
    with urllib.request.urlopen(ROOT_URL + "/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4"), r.headers["Content-Type"]
        text = r.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def wait_until(what, predicate, limit_s):
    """Polls `predicate` until it holds; fails after `limit_s`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > limit_s:
            raise AssertionError(f"{what}: not within {limit_s} s")
        time.sleep(0.01)


def wait_idle(limit_s):
    """Seconds until /health reports idle; fails after `limit_s`."""
    start = time.monotonic()
    while health()["busy"]:
        if time.monotonic() - start > limit_s:
            raise AssertionError(f"server still generating {limit_s} s later")
        time.sleep(0.01)
    return time.monotonic() - start


def deltafin_nll(ids):
    """`deltafin nll --ids ... --json` as a dict (per-position negative log-likelihoods)."""
    out = subprocess.run(
        [DELTAFIN, "nll", "--model", MODEL_DIR, "--json", "--ids", ",".join(map(str, ids))],
        check=True,
        capture_output=True,
        text=True,
        timeout=REQUEST_TIMEOUT,
    )
    return json.loads(out.stdout)


def deltafin_run(*args):
    """`deltafin run ... --json` as a dict (the reference for greedy answers)."""
    out = subprocess.run(
        [DELTAFIN, "run", "--model", MODEL_DIR, "--json", *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=REQUEST_TIMEOUT,
    )
    return json.loads(out.stdout)


def chat_stream(c, **kwargs):
    """Streams a chat answer; returns (reasoning, content, finish_reason, usage, n_chunks)."""
    reasoning, content, finish, usage, n = [], [], None, None, 0
    stream = c.chat.completions.create(stream=True, **kwargs)
    with stream:
        for chunk in stream:
            n += 1
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                reasoning.append(extra(choice.delta, "reasoning_content", ""))
                content.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
    return "".join(reasoning), "".join(content), finish, usage, n


class OpenAIClientTest(unittest.TestCase):
    def setUp(self):
        wait_idle(30)

    def test_models(self):
        ids = [m.id for m in client().models.list().data]
        self.assertEqual(ids, [MODEL])
        self.assertEqual(client().models.retrieve(MODEL).id, MODEL)

    def test_chat_matches_deltafin_run_and_streaming_reassembles(self):
        c = client()
        prompt, max_new = "Hello there", 24
        full = c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_new,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        choice = full.choices[0]
        # Greedy: the same prompt ids and the same new ids as `deltafin run --chat`.
        reference = deltafin_run("--prompt", prompt, "--chat", "--max-new", str(max_new))
        self.assertEqual(extra(full, "prompt_token_ids"), reference["prompt_ids"])
        self.assertEqual(extra(choice, "token_ids"), reference["new_ids"])
        self.assertEqual(full.usage.prompt_tokens, len(reference["prompt_ids"]))
        self.assertEqual(full.usage.completion_tokens, len(reference["new_ids"]))
        self.assertEqual(choice.message.role, "assistant")
        self.assertEqual(choice.finish_reason, "length" if len(reference["new_ids"]) == max_new else "stop")

        # Streamed: reasoning and content deltas reassemble to the non-streamed answer.
        reasoning, content, finish, usage, n = chat_stream(
            c,
            model=MODEL,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_new,
            temperature=0,
            stream_options={"include_usage": True},
        )
        self.assertGreater(n, 2)
        self.assertEqual(reasoning, extra(choice.message, "reasoning_content", ""))
        self.assertEqual(content, choice.message.content or "")
        self.assertTrue(reasoning or content)
        self.assertEqual(finish, choice.finish_reason)
        self.assertIsNotNone(usage)
        self.assertEqual(usage.completion_tokens, full.usage.completion_tokens)
        self.assertEqual(usage.prompt_tokens, full.usage.prompt_tokens)

    def test_thinking_off(self):
        c = client()
        for switch in ({"chat_template_kwargs": {"thinking": False}}, {"reasoning_effort": "none"}):
            r = c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Hello there"}],
                max_tokens=8,
                extra_body={"return_token_ids": True, **switch},
            )
            reference = deltafin_run("--prompt", "Hello there", "--chat", "--no-thinking", "--max-new", "8")
            self.assertEqual(extra(r, "prompt_token_ids"), reference["prompt_ids"], switch)
            self.assertEqual(extra(r.choices[0], "token_ids"), reference["new_ids"], switch)
            self.assertEqual(extra(r.choices[0].message, "reasoning_content", ""), "")

    def test_completions(self):
        c = client()
        full = c.completions.create(
            model=MODEL, prompt="abc", max_tokens=16, temperature=0, extra_body={"return_token_ids": True}
        )
        reference = deltafin_run("--prompt", "abc", "--max-new", "16")
        self.assertEqual(extra(full.choices[0], "token_ids"), reference["new_ids"])
        self.assertEqual(full.usage.prompt_tokens, len(reference["prompt_ids"]))
        text = full.choices[0].text
        streamed, finish = [], None
        with c.completions.create(model=MODEL, prompt="abc", max_tokens=16, temperature=0, stream=True) as s:
            for chunk in s:
                for ch in chunk.choices:
                    streamed.append(ch.text)
                    finish = ch.finish_reason or finish
        self.assertEqual("".join(streamed), text)
        self.assertEqual(finish, full.choices[0].finish_reason)

    def test_stop_string_is_not_returned(self):
        c = client()
        text = c.completions.create(model=MODEL, prompt="abc", max_tokens=40, temperature=0).choices[0].text
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        cut = c.completions.create(model=MODEL, prompt="abc", max_tokens=40, temperature=0, stop=[stop])
        self.assertEqual(cut.choices[0].text, text[: text.index(stop)])
        self.assertEqual(cut.choices[0].finish_reason, "stop")

    def test_tool_call_round_trip(self):
        c = client()
        tools = [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Current weather in a city",
                    "parameters": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}},
                        "required": ["city"],
                    },
                },
            }
        ]
        messages = [
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        ]
        r = c.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice="auto", max_tokens=8)
        self.assertIn(r.choices[0].finish_reason, ("stop", "length", "tool_calls"))
        self.assertGreater(r.usage.prompt_tokens, 50)
        if r.choices[0].finish_reason == "tool_calls":
            self.assertTrue(r.choices[0].message.tool_calls)
        # Streamed too.
        _, _, finish, _, _ = chat_stream(c, model=MODEL, messages=messages, tools=tools, max_tokens=8)
        self.assertEqual(finish, r.choices[0].finish_reason)

    def test_second_turn_reuses_the_first(self):
        c = client()
        first = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=6
        )
        reply = first.choices[0].message
        second = c.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "user", "content": "Hello there"},
                {
                    "role": "assistant",
                    "content": reply.content,
                    "reasoning_content": extra(reply, "reasoning_content", ""),
                },
                {"role": "user", "content": "And then?"},
            ],
            max_tokens=6,
        )
        cached = second.usage.prompt_tokens_details.cached_tokens
        self.assertGreater(cached, 0)
        self.assertLessEqual(cached, first.usage.prompt_tokens)

    def test_errors(self):
        c = client()
        with self.assertRaises(openai.NotFoundError):
            c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
        with self.assertRaises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=[])
        self.assertEqual(e.exception.body.get("param"), "messages")
        with self.assertRaises(openai.BadRequestError) as e:
            c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=21
            )
        self.assertEqual(e.exception.body.get("param"), "top_logprobs")
        with self.assertRaises(openai.BadRequestError) as e:
            c.completions.create(model=MODEL, prompt="")
        self.assertEqual(e.exception.body.get("param"), "prompt")

    def test_queue_serves_in_order_says_positions_and_is_429_only_when_full(self):
        """A running generation, two waiters (the server runs with --max-queue 2), then a refusal."""
        c = client()
        stream = c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me a long story"}],
            max_tokens=400,
            stream=True,
        )
        finished = []
        errors = []

        def ask(name, **kwargs):
            try:
                r = client().chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": name}], max_tokens=3, **kwargs
                )
                finished.append((name, r.usage.completion_tokens))
            except Exception as e:  # reported below
                errors.append((name, e))

        with stream:
            chunks = iter(stream)
            next(chunks)  # the role chunk: the first generation holds the engine
            self.assertTrue(health()["busy"])
            second = threading.Thread(target=ask, args=("second",))
            second.start()
            wait_until("second queued", lambda: health()["queued"] == 1, 10)
            # A streamed waiter is told its position in SSE comments (raw HTTP: the SDK hides comments).
            raw = urllib.request.Request(
                BASE_URL + "/chat/completions",
                data=json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "third"}],
                                 "max_tokens": 3, "stream": True}).encode(),
                headers={"Content-Type": "application/json"},
            )
            third = urllib.request.urlopen(raw, timeout=REQUEST_TIMEOUT)
            self.assertEqual(third.readline().decode().strip(), ": queued, position 2")
            self.assertEqual(health()["queued"], 2)
            self.assertEqual(metrics()["deltafin_queue_waiting"], 2)
            # The queue is full: 429 with Retry-After.
            with self.assertRaises(openai.RateLimitError) as e:
                client().chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "fourth"}], max_tokens=2
                )
            self.assertEqual(e.exception.status_code, 429)
            self.assertTrue(e.exception.response.headers.get("retry-after"))
            self.assertEqual(e.exception.body.get("code"), "server_busy")
            first_done = None
            for chunk in chunks:
                for ch in chunk.choices:
                    first_done = ch.finish_reason or first_done
            first_end = time.monotonic()
        # All three answered, in arrival order: the first, then the second, then the third.
        body = third.read().decode()
        third_end = time.monotonic()
        third.close()
        second.join(REQUEST_TIMEOUT)
        self.assertEqual(errors, [])
        self.assertIn(first_done, ("length", "stop"))
        self.assertEqual([name for name, _ in finished], ["second"])
        self.assertIn("data: [DONE]", body)
        self.assertIn(": queued, position 1", body)
        self.assertGreater(third_end, first_end)
        self.assertLess(wait_idle(5), 5)

    def test_three_concurrent_requests_are_all_answered_in_order(self):
        order = []
        lock = threading.Lock()

        def ask(i):
            r = client().chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Tell me a long story {i}"}], max_tokens=200
            )
            with lock:
                order.append((i, r.usage.completion_tokens))

        threads = []
        for i in range(3):
            t = threading.Thread(target=ask, args=(i,))
            t.start()
            threads.append(t)
            # Each one in line before the next is sent, so that the arrival order is known.
            wait_until(f"request {i} in", lambda: health()["busy"] and health()["queued"] == i, 10)
        for t in threads:
            t.join(REQUEST_TIMEOUT)
        self.assertEqual([i for i, _ in order], [0, 1, 2])

    def test_a_waiter_that_goes_away_leaves_the_queue(self):
        c = client()
        stream = c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me a long story"}],
            max_tokens=3000,
            stream=True,
        )
        with stream:
            next(iter(stream))
            impatient = openai.OpenAI(base_url=BASE_URL, api_key="unused", max_retries=0, timeout=0.5)
            with self.assertRaises(openai.APITimeoutError):
                impatient.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "me?"}], max_tokens=2
                )
            wait_until("the waiter left", lambda: health()["queued"] == 0, 5)
            self.assertTrue(health()["busy"])
        self.assertLess(wait_idle(5), 5)

    def test_json_schema_is_enforced(self):
        """Random weights write noise: only the grammar can make these answers valid."""
        schema = {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "tags": {"type": "array", "items": {"type": "string", "enum": ["sun", "rain"]}, "maxItems": 3},
                "metric": {"type": "boolean"},
            },
            "required": ["city", "days", "tags", "metric"],
            "additionalProperties": False,
        }
        c = client()
        for temperature, seed in ((0, 0), (1.0, 1), (1.0, 2), (0.8, 3)):
            for stream in (False, True):
                kwargs = dict(
                    model=MODEL,
                    messages=[{"role": "user", "content": "Weather for the trip?"}],
                    max_tokens=300,
                    temperature=temperature,
                    seed=seed,
                    response_format={
                        "type": "json_schema",
                        "json_schema": {"name": "trip", "strict": True, "schema": schema},
                    },
                    reasoning_effort="none",
                )
                if stream:
                    _, content, finish, _, _ = chat_stream(c, **kwargs)
                else:
                    r = c.chat.completions.create(**kwargs)
                    content, finish = r.choices[0].message.content, r.choices[0].finish_reason
                self.assertEqual(finish, "stop", content)
                jsonschema.validate(json.loads(content), schema)
        # json_object: any JSON object.
        r = c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "JSON please"}],
            max_tokens=300,
            response_format={"type": "json_object"},
            extra_body={"chat_template_kwargs": {"thinking": False}},
        )
        if r.choices[0].finish_reason == "stop":
            self.assertIsInstance(json.loads(r.choices[0].message.content), dict)
        else:
            self.assertTrue(r.choices[0].message.content.startswith("{"), r.choices[0].message.content)
        # Without the constraint the same model does not write JSON.
        free = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather for the trip?"}], max_tokens=40,
            reasoning_effort="none",
        ).choices[0].message.content
        with self.assertRaises((ValueError, jsonschema.ValidationError)):
            jsonschema.validate(json.loads(free), schema)

    def test_tool_arguments_follow_each_tools_schema(self):
        weather = {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        }
        lookup = {
            "type": "object",
            "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["code"],
            "additionalProperties": False,
        }
        tools = [
            {"type": "function", "function": {"name": "get_weather", "parameters": weather, "strict": True}},
            {"type": "function", "function": {"name": "lookup", "parameters": lookup}},
        ]
        schemas = {"get_weather": weather, "lookup": lookup}
        c = client()
        seen = set()
        for temperature, seed in ((0, 0), (1.0, 1), (1.0, 2), (1.0, 3), (1.0, 4)):
            r = c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Weather in Paris?"}],
                tools=tools,
                tool_choice="required",
                parallel_tool_calls=False,
                max_tokens=300,
                temperature=temperature,
                seed=seed,
                reasoning_effort="none",
            )
            choice = r.choices[0]
            self.assertEqual(choice.finish_reason, "tool_calls")
            self.assertEqual(len(choice.message.tool_calls), 1)
            for call in choice.message.tool_calls:
                seen.add(call.function.name)
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        self.assertTrue(seen)

    def test_logprobs_equal_deltafin_nll(self):
        c = client()
        prompt = [556, 64, 65, 66, 67, 68]
        r = c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=5,
            extra_body={"return_token_ids": True},
        )
        choice = r.choices[0]
        new = extra(choice, "token_ids")
        self.assertEqual(len(choice.logprobs.token_logprobs), len(new))
        reference = deltafin_nll(prompt + new)
        for i, logprob in enumerate(choice.logprobs.token_logprobs):
            nll = reference["nll"][len(prompt) - 1 + i]
            self.assertAlmostEqual(logprob, -nll, delta=1e-4)
            # Greedy: the top alternative is the chosen token, as `nll`'s top-5 says.
            position = len(prompt) - 1 + i
            self.assertEqual(reference["top5"][position][0], new[i])
            # Keyed by token text: tokens whose bytes read the same (partial UTF-8) share an entry.
            top = choice.logprobs.top_logprobs[i]
            self.assertTrue(1 <= len(top) <= 5, top)
            lse = reference["top5_logits"][position][0] + nll
            self.assertAlmostEqual(max(top.values()), reference["top5_logits"][position][0] - lse, delta=1e-4)

        # Chat, streamed, with 20 alternatives: the same numbers as nll over the rendered prompt and the answer.
        stream = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=10, stream=True,
            logprobs=True, top_logprobs=20, extra_body={"return_token_ids": True},
        )
        entries, ids, prompt_ids = [], [], None
        with stream:
            for chunk in stream:
                prompt_ids = extra(chunk, "prompt_token_ids", prompt_ids)
                for ch in chunk.choices:
                    ids.extend(extra(ch, "token_ids", []))
                    if ch.logprobs and ch.logprobs.content:
                        entries.extend(ch.logprobs.content)
        self.assertEqual(len(entries), len(ids))
        reference = deltafin_nll(prompt_ids + ids)
        for i, entry in enumerate(entries):
            self.assertAlmostEqual(entry.logprob, -reference["nll"][len(prompt_ids) - 1 + i], delta=1e-4)
            self.assertEqual(len(entry.top_logprobs), 20)

    def test_metrics(self):
        before = metrics()
        r = client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "count me"}], max_tokens=5
        )
        after = metrics()
        grew = lambda name: after[name] - before[name]
        self.assertEqual(grew('deltafin_requests_total{endpoint="chat"}'), 1)
        self.assertEqual(grew("deltafin_generated_tokens_total"), r.usage.completion_tokens)
        self.assertEqual(grew("deltafin_prompt_tokens_total"), r.usage.prompt_tokens)
        self.assertGreater(grew("deltafin_decode_seconds_total"), 0)
        self.assertGreaterEqual(grew("deltafin_prefill_seconds_total"), 0)
        self.assertGreater(after["deltafin_expert_cache_hits_total"] + after["deltafin_expert_cache_misses_total"], 0)
        for name in ('deltafin_read_bytes_total{kind="experts"}', "deltafin_speculation_drafted_total",
                     "deltafin_speculation_accepted_total", "deltafin_queue_waiting"):
            self.assertIn(name, after)

    def test_disconnect_mid_stream_frees_the_engine(self):
        c = client()
        # Without the disconnect this generation would run for tens of seconds.
        stream = c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me a long story"}],
            max_tokens=3000,
            stream=True,
        )
        seen = 0
        for _ in stream:
            seen += 1
            if seen == 10:
                break
        self.assertTrue(health()["busy"])
        stream.close()
        waited = wait_idle(3)
        print(f"\n  idle {waited * 1000:.0f} ms after the client disconnected", flush=True)
        start = time.monotonic()
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        self.assertEqual(r.usage.completion_tokens, 2)
        self.assertLess(time.monotonic() - start, 10)


if __name__ == "__main__":
    unittest.main(verbosity=2)
