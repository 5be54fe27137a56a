"""The evaluation and promotion pages in Chromium (Playwright) against `kiln up` (embedded worker, SQLite,
the real trainer on kiln-tiny): a gated SFT job trains, its gate evaluates and promotes it, and a manual
evaluation with a long unbroken expected answer runs; then the evaluation list, the gate's run page, the
manual run's page and the promotions page open at 1280x800 and 390x844 without horizontal scrolling."""

import json
import time

import pytest

from .browser import DESKTOP, PHONE, chromium_browser, no_horizontal_scroll, open_page, served, shot, sign_in

pytestmark = pytest.mark.slow

LONG = "glaze" * 60  # one 300-character word: an answer column must wrap it, not widen the page
SUITE = [{"prompt": "Say kiln.", "expected": ".*", "metric": "regex"},
         {"prompt": "Repeat glaze sixty times without spaces. " * 3, "expected": LONG},
         {"messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a clay."}],
          "expected": "kaolin", "metric": "contains"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with served(tmp_path_factory, "kiln-evals-home") as running:  # the embedded worker is enough
        yield running


def wait_for(read, until, what: str, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = read()
        if until(value):
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what} did not happen within {timeout:g} s: last {value}")


def test_evaluation_and_promotion_pages_fit_desktop_and_phone(stack):
    api = stack.client
    content = "".join(json.dumps(line) + "\n" for line in SUITE)
    api.request("POST", "/evals/suites", {"name": "held-out", "content": content})
    data = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(3)]
    job = api.submit_sft({"data": data, "config": {"output_name": "evals-bot", "epochs": 1, "seed": 3},
                          "auto_load": True, "gate": {"suite": "held-out", "min_improvement": -1.0}})
    undecided = (None, "pending", "pending_canary")
    job = wait_for(lambda: api.job(job["id"]), lambda j: j["promotion"]["outcome"] not in undecided,
                   "the gate's decision")
    assert job["status"] == "succeeded" and job["evaluation_ids"], job
    gate_run = job["evaluation_ids"][0]
    manual = api.request("POST", "/evals/runs", {"adapter": "evals-bot", "suite": "held-out"})
    wait_for(lambda: api.request("GET", f"/evals/runs/{manual['id']}"), lambda r: r["status"] == "succeeded",
             "the manual evaluation")

    with chromium_browser() as browser:
        page = open_page(browser, DESKTOP)
        sign_in(page, stack, "/evals/")
        page.wait_for_selector("[data-eval-runs]")
        assert page.locator("[data-run]").count() == 2
        pages = {"evals": "/evals/", "gate-run": f"/evals/runs/{gate_run}/",
                 "manual-run": f"/evals/runs/{manual['id']}/", "promotions": "/promotions/"}
        for size_name, size in (("desktop", DESKTOP), ("phone", PHONE)):
            page.set_viewport_size(size)
            for name, path in pages.items():
                page.goto(stack.url + path)
                page.wait_for_selector("h1")
                if name.endswith("-run"):
                    assert page.locator("[data-example]").count() == len(SUITE)
                if name == "gate-run":
                    assert page.locator("[data-gate] .badge").count() == 1
                if name == "promotions":
                    assert page.locator(f"[data-promotion] a[href='/evals/runs/{gate_run}/']").count() == 1
                shot(page, f"evals-{name}-{size_name}")
                no_horizontal_scroll(page)
        assert page.errors == []
