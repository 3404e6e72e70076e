"""The chat page at `/` in headless Chromium (selenium): send a message, watch the answer stream in, stop it.

Run by tests/e2e/run_e2e.py (see tests/e2e/browser/run.sh), which starts the server and sets OPENAI_BASE_URL and
DELTAFIN_E2E_MODEL_ID. The fixture has random weights: the text is noise, but it streams like a real answer.
Every wait is bounded.
"""

import json
import os
import shutil
import tempfile
import time
import unittest
import urllib.request

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

BASE_URL = os.environ["OPENAI_BASE_URL"]
ROOT_URL = BASE_URL.rsplit("/v1", 1)[0]
MODEL = os.environ["DELTAFIN_E2E_MODEL_ID"]
WAIT_S = 30


def health():
    with urllib.request.urlopen(ROOT_URL + "/health", timeout=10) as r:
        return json.load(r)


class ChatPageTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.profile = tempfile.mkdtemp(prefix="deltafin-chromium-")
        options = webdriver.ChromeOptions()
        options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
        # Root in a container, no display, and a closed network: no sandbox, no GPU, no background traffic.
        for flag in (
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-quic",
            "--no-first-run",
            f"--user-data-dir={cls.profile}",
        ):
            options.add_argument(flag)
        service = Service(executable_path=shutil.which("chromedriver") or "/usr/bin/chromedriver")
        cls.driver = webdriver.Chrome(options=options, service=service)
        cls.driver.set_page_load_timeout(WAIT_S)

    @classmethod
    def tearDownClass(cls):
        cls.driver.quit()
        shutil.rmtree(cls.profile, ignore_errors=True)

    def wait(self, what, predicate, timeout=WAIT_S):
        return WebDriverWait(self.driver, timeout, poll_frequency=0.02).until(
            lambda d: predicate(), message=what
        )

    def el(self, css):
        return self.driver.find_element(By.CSS_SELECTOR, css)

    def last_answer(self):
        return self.driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]

    def answer_text(self):
        """Reasoning and content of the latest answer, as shown."""
        answer = self.last_answer()
        reasoning = answer.find_element(By.CSS_SELECTOR, ".reasoning-text").get_attribute("textContent")
        content = answer.find_element(By.CSS_SELECTOR, ".content").get_attribute("textContent")
        return reasoning, content

    def send(self, text):
        box = self.el("#input")
        box.clear()
        box.send_keys(text)
        self.el("#send").click()

    def test_send_watch_it_stream_and_stop(self):
        d = self.driver
        d.get(ROOT_URL + "/")
        self.wait("the model id is shown", lambda: self.el("#model").text == MODEL)
        self.assertTrue(self.el("#thinking").is_selected(), "thinking is on by default")
        self.assertTrue(self.el("#stop").get_attribute("disabled"))

        # Thinking on, a long answer: the reasoning streams into its own box, piece by piece.
        self.send("Tell me a long story")
        self.wait("the stop button is enabled", lambda: not self.el("#stop").get_attribute("disabled"))
        lengths = []

        def grew():
            reasoning, content = self.answer_text()
            n = len(reasoning) + len(content)
            if n and (not lengths or n > lengths[-1]):
                lengths.append(n)
            return len(lengths) >= 3

        self.wait("streamed text arrives in pieces", grew)
        reasoning, _ = self.answer_text()
        self.assertTrue(reasoning, "K3 thinks first: the text arrives as reasoning")
        details = self.last_answer().find_element(By.CSS_SELECTOR, "details.reasoning")
        self.assertIsNone(details.get_attribute("hidden"), "the reasoning box is shown")
        self.assertTrue(health()["busy"])

        # Stop: the page says so, and the server stops generating at once.
        self.el("#stop").click()
        self.wait("the page says stopped", lambda: self.el("#status").text == "stopped")
        start = time.monotonic()
        while health()["busy"]:
            self.assertLess(time.monotonic() - start, 5, "the server still generates after stop")
            time.sleep(0.02)
        stopped_at = len("".join(self.answer_text()))
        time.sleep(0.3)
        self.assertEqual(len("".join(self.answer_text())), stopped_at, "nothing arrives after stop")
        self.assertIsNone(self.el("#send").get_attribute("disabled"))
        print(f"\n  streamed {lengths[:6]}... characters, stopped at {stopped_at}", flush=True)

        # Thinking off, a short answer: no reasoning, the answer completes.
        self.el("#thinking").click()
        self.assertTrue(self.el("#effort").get_attribute("disabled"))
        max_tokens = self.el("#max-tokens")
        max_tokens.clear()
        max_tokens.send_keys("8")
        self.send("Say hello")
        self.wait("the answer completes", lambda: self.el("#status").text == "done")
        reasoning, _ = self.answer_text()
        self.assertEqual(reasoning, "")
        self.assertRegex(self.last_answer().text, r"\b[1-8] tokens, finish: (length|stop)")
        self.assertEqual(len(d.find_elements(By.CSS_SELECTOR, ".msg.user")), 2)


if __name__ == "__main__":
    unittest.main(verbosity=2)
