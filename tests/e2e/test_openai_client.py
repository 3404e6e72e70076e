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


def health():
    with urllib.request.urlopen(BASE_URL.rsplit("/v1", 1)[0] + "/health", timeout=10) as r:
        return json.load(r)


def wait_idle(limit_s):
    """Seconds until /health reports idle; fails after `limit_s`."""
    start = time.monotonic()
    while health()["busy"]:
        if time.monotonic() - start > limit_s:
            raise AssertionError(f"server still generating {limit_s} s later")
        time.sleep(0.01)
    return time.monotonic() - start


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
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], logprobs=True)
        self.assertEqual(e.exception.body.get("param"), "logprobs")
        with self.assertRaises(openai.BadRequestError) as e:
            c.completions.create(model=MODEL, prompt="")
        self.assertEqual(e.exception.body.get("param"), "prompt")

    def test_concurrent_request_is_429_and_the_first_completes(self):
        c = client()
        max_new = 1500
        stream = c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me a long story"}],
            max_tokens=max_new,
            stream=True,
            stream_options={"include_usage": True},
        )
        with stream:
            chunks = iter(stream)
            next(chunks)  # the role chunk: the first generation holds the engine
            self.assertTrue(health()["busy"])
            with self.assertRaises(openai.RateLimitError) as e:
                client().chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "me too"}], max_tokens=2
                )
            self.assertEqual(e.exception.status_code, 429)
            self.assertTrue(e.exception.response.headers.get("retry-after"))
            self.assertEqual(e.exception.body.get("code"), "server_busy")
            finish, usage = None, None
            for chunk in chunks:
                usage = chunk.usage or usage
                for ch in chunk.choices:
                    finish = ch.finish_reason or finish
        self.assertIn(finish, ("length", "stop"))
        self.assertIsNotNone(usage)
        self.assertLessEqual(usage.completion_tokens, max_new)
        if finish == "length":
            self.assertEqual(usage.completion_tokens, max_new)
        # Idle at once, and the next request is served.
        self.assertLess(wait_idle(5), 5)
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        self.assertEqual(r.usage.completion_tokens, 2)

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

    def test_concurrent_threads_one_wins(self):
        """Several clients at once: every answer is a success or a 429; at least one succeeds."""
        results = []

        def ask():
            try:
                client().chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "race"}], max_tokens=50
                )
                results.append("ok")
            except openai.RateLimitError:
                results.append("429")

        threads = [threading.Thread(target=ask) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(REQUEST_TIMEOUT)
        self.assertEqual(len(results), 4)
        self.assertIn("ok", results)


if __name__ == "__main__":
    unittest.main(verbosity=2)
