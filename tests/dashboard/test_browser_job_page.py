"""The job page in Chromium (Playwright) against Kiln as deployed (`kiln up`, a separate Celery worker, Redis,
the real trainer on kiln-tiny), at 1280x800 and 390x844:

- a gated auto-load job's promotion panel says "Awaiting the gate" while it trains and turns "Promoted"
  without a reload (the gate's evaluation runs on the worker; its news reaches the page as job events);
- a run without checkpointing offers "Stop (no checkpoint)" and stops only after the confirmation;
- the loss chart's y-axis never reaches below zero; the learning-rate, gradient-norm and tokens/s charts
  are drawn; the time-left estimate is a moving average that one slow step does not swing.

The server runs with checkpointing off (KILN_CHECKPOINT_INTERVAL=off), so every job here runs without one.
"""

import json
import re

import pytest

from .browser import DESKTOP, PHONE, chromium_browser, no_horizontal_scroll, served, sign_in

pytestmark = pytest.mark.slow

WORDS = ("kiln", "clay", "glaze", "fire")
DATA = [{"messages": [{"role": "user", "content": f"Say {w}."}, {"role": "assistant", "content": f"{w.upper()}!"}]}
        for w in WORDS]
SUITE = [{"prompt": f"Say {w}.", "expected": "."} for w in ("kiln", "clay")]  # regex "." : any answer passes
TIMEOUT_MS = 120_000  # a wait for the worker (training, evaluation, canary) on a 2-core CI machine


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # a Redis database of its own, and no checkpointing unless a request asks for it
    with served(tmp_path_factory, "kiln-job-page-home", redis_db=13, KILN_CHECKPOINT_INTERVAL="off",
                KILN_DEFAULT_BASE="kiln-tiny") as running:
        yield running


@pytest.fixture(scope="module")
def chromium(stack):
    with chromium_browser() as browser:
        yield browser


@pytest.fixture(scope="module")
def session(stack, chromium) -> dict:
    """The signed-in admin's cookies, for a page at each viewport."""
    context = chromium.new_context(viewport=DESKTOP)
    page = context.new_page()
    sign_in(page, stack)
    page.wait_for_selector("text=Training jobs")
    state = context.storage_state()
    context.close()
    return state


def pages_at_both_sizes(chromium, session, url: str) -> list:
    """The same job page open at 1280x800 and at 390x844, each collecting page errors in .errors."""
    pages = []
    for viewport in (DESKTOP, PHONE):
        context = chromium.new_context(viewport=viewport, storage_state=session)
        context.set_default_timeout(30_000)
        page = context.new_page()
        page.errors, page.sockets, page.snapshots = [], [], []
        page.on("pageerror", lambda error, page=page: page.errors.append(str(error)))
        page.on("request", lambda request, page=page: "/snapshot" in request.url and page.snapshots.append(request.url))
        # the page's WebSockets pass through here unchanged, so a test can also speak as the server
        page.route_web_socket(re.compile(r"/ws/jobs/"),
                              lambda ws, page=page: (ws.connect_to_server(), page.sockets.append(ws)))
        page.goto(url)
        page.wait_for_function("document.querySelector('[data-live-indicator]').dataset.state === 'live'")
        page.evaluate("window.__sameDocument = true")
        pages.append(page)
    return pages


def close(pages) -> None:
    for page in pages:
        assert not page.errors, page.errors
        page.context.close()


def test_the_promotion_panel_turns_promoted_without_a_reload(stack, chromium, session):
    stack.client.request("POST", "/evals/suites", {"name": "held-out", "default_metric": "regex", "content": "".join(
        json.dumps(example) + "\n" for example in SUITE)})
    stack.hold("gated-bot", step=2)  # trains two steps, then waits until released
    job = stack.submit({"data": DATA, "config": {"output_name": "gated-bot", "epochs": 2, "seed": 8},
                        "auto_load": True, "gate": {"suite": "held-out", "min_accuracy": 0.0}})
    stack.wait_held("gated-bot", job["id"])
    pages = pages_at_both_sizes(chromium, session, f"{stack.url}/jobs/{job['id']}/")
    for page in pages:  # asked for a gate: awaiting it from the start, not "Not requested"
        assert page.get_attribute("[data-promotion]", "data-promotion") == "pending"
        assert "Awaiting the gate" in page.inner_text("[data-promotion]")
        assert "held-out" in page.inner_text("[data-promotion]")
        no_horizontal_scroll(page)

    # a second job, queued behind the first on the worker (one task at a time) and held there, keeps the
    # gate's evaluation waiting after the first job succeeds: the page has to learn of the evaluation and
    # of the promotion from job events alone, well after the job's last status event
    stack.hold("blocker-bot", step=1)
    blocker = stack.submit({"data": DATA, "config": {"output_name": "blocker-bot", "epochs": 1, "seed": 1}})
    stack.release("gated-bot")
    stack.wait_held("blocker-bot", blocker["id"])
    for page in pages:
        page.wait_for_selector("[data-evaluations='1'] .status-queued", timeout=TIMEOUT_MS)
        assert page.get_attribute("[data-promotion]", "data-promotion") == "pending"
        assert page.get_attribute("[data-trained]", "data-trained") == "yes"

    # a job event alone makes the page re-read every panel, and a burst of them costs one request
    for page in pages:
        asked, sockets = len(page.snapshots), len(page.sockets)
        for n in range(5):
            page.sockets[-1].send(json.dumps({"type": "job.event", "job_id": job["id"], "level": "info",
                                              "time": "2026-01-01T00:00:00Z", "message": f"burst {n}"}))
        burst = "document.querySelector('[data-events]').textContent.includes('burst 4')"
        page.wait_for_function(burst)  # shown at once, as pushed ...
        # ... then the panels re-read: the server's events replace them (well before any reconnect would)
        page.wait_for_function(f"!({burst})", timeout=TIMEOUT_MS)
        assert len(page.sockets) == sockets, "the page reconnected: a resync after a reconnect proves nothing here"
        assert len(page.snapshots) == asked + 1, page.snapshots[asked:]  # the burst's one snapshot

    stack.client.cancel(blocker["id"])  # the worker is free: the evaluation runs, then the canary
    for page in pages:
        page.wait_for_selector("[data-promotion=promoted]", timeout=TIMEOUT_MS)
        assert page.evaluate("window.__sameDocument") is True  # redrawn in place, never reloaded
        assert "Promoted" in page.inner_text("[data-promotion]")
        page.wait_for_selector("[data-evaluations] .status-succeeded")
        assert "held-out" in page.inner_text("[data-evaluations]")
        run_id = stack.client.job(job["id"])["evaluation_ids"][0]
        assert page.get_attribute("[data-eval-link]", "href") == f"/evals/runs/{run_id}/"
        assert "promotion: promoted" in page.inner_text("[data-events]")
        no_horizontal_scroll(page)
    close(pages)


def test_a_run_without_checkpoints_stops_only_when_confirmed(stack, chromium, session):
    stack.hold("unsaved-bot", step=1)
    job = stack.submit({"data": DATA, "config": {"output_name": "unsaved-bot", "epochs": 25, "seed": 3}})
    assert stack.client.job(job["id"])["effective_config"]["checkpoint_interval"] is None
    stack.wait_held("unsaved-bot", job["id"])
    desktop, phone = pages_at_both_sizes(chromium, session, f"{stack.url}/jobs/{job['id']}/")
    for page in (desktop, phone):
        assert page.inner_text("[data-stop]") == "Stop (no checkpoint)"
        assert page.locator("text=Stop and save").count() == 0
        no_horizontal_scroll(page)

    # the first press only opens the confirmation
    phone.click("[data-stop]")
    phone.wait_for_selector("[data-stop-confirm]", state="visible")
    no_horizontal_scroll(phone)
    assert stack.client.job(job["id"])["status"] == "running"

    # the same form without its confirmation (what a plain POST sends) is refused, and says why
    desktop.click("[data-stop]")
    desktop.eval_on_selector("[data-stop-confirm]", "button => button.form.querySelector('[name=confirm]').remove()")
    desktop.click("[data-stop-confirm]")
    desktop.wait_for_selector("text=Not stopped: checkpointing is off for this run")
    assert stack.client.job(job["id"])["status"] == "running"

    # confirmed: it stops, and the page says nothing was saved
    phone.click("[data-stop-confirm]")
    phone.wait_for_selector("[data-stop-state=none]", timeout=TIMEOUT_MS)
    assert "without a checkpoint" in phone.inner_text("[data-panel=stop]")
    assert stack.client.job(job["id"])["status"] == "cancelled"
    desktop.wait_for_selector("[data-stop-state=none]", timeout=TIMEOUT_MS)  # the other page follows live
    stack.release("unsaved-bot")
    close([desktop, phone])


def test_charts_floor_the_loss_at_zero_and_show_rates(stack, chromium, session):
    job = stack.submit({"data": DATA, "config": {"output_name": "charted-bot", "epochs": 3, "seed": 5}})
    stack.wait(job["id"], lambda j: j["status"] == "succeeded")
    for page in pages_at_both_sizes(chromium, session, f"{stack.url}/jobs/{job['id']}/"):
        page.wait_for_selector("[data-chart=loss] svg path[data-series=run]")
        low = float(page.get_attribute("[data-chart=loss] svg", "data-y-min"))
        assert low >= 0, f"the loss axis starts at {low}"
        assert float(page.get_attribute("[data-chart=loss] svg", "data-y-max")) > low
        labels = page.eval_on_selector_all("[data-chart=loss] svg text", "ts => ts.map(t => t.textContent)")
        assert not [label for label in labels if label.startswith("-")], labels
        for key in ("learning_rate", "grad_norm", "tokens_per_second"):
            figure = page.locator(f"[data-chart={key}]")
            assert figure.is_visible(), f"the {key} chart is hidden"
            assert int(figure.locator("path[data-series=run]").get_attribute("data-points")) == 12
        rate = page.inner_text("[data-chart=tokens_per_second] [data-latest]")
        assert re.fullmatch(r"[0-9.]+ at step 12", rate), rate
        no_horizontal_scroll(page)

        # the time-left estimate: one slow warm-up step and one slow checkpoint step barely move it
        steps = [{"step": 1, "elapsed_seconds": 5.0}] + [{"step": s, "elapsed_seconds": 5.0 + (s - 1)}
                                                          for s in range(2, 41)]
        steady = page.evaluate("points => window.KilnJob.stepSeconds(points)", steps)
        assert steady == pytest.approx(1.0, abs=0.05)
        slow = [dict(p, elapsed_seconds=p["elapsed_seconds"] + (4 if p["step"] >= 30 else 0)) for p in steps]
        assert 1.0 < page.evaluate("points => window.KilnJob.stepSeconds(points)", slow) < 1.5
        rates = page.evaluate("points => window.KilnJob.tokensPerSecond(points)",
                              [{"step": 4, "elapsed_seconds": 2.0, "tokens": 10}, {"step": 5, "elapsed_seconds": 2.5,
                                                                                   "tokens": 10}])
        assert rates == [[4, 5.0], [5, 20.0]]
        assert not page.errors, page.errors
        page.context.close()
