"""The dashboard in Chromium (Playwright) against Kiln as deployed: `kiln up` serving the ASGI app, a
SEPARATE Celery worker process, Redis as broker and channel layer, the real trainer on kiln-tiny.

One story, a screenshot per step under test-output/dashboard/: sign in; submit an SFT job from the
form (no checkpoint interval: the server's default); watch progress advance without reloading (detail
page and jobs list), through a dropped and re-established WebSocket; stop and save; see the confirmed
checkpoint; prepare resume; see the form refuse without data; supply it; submit; see the
job succeed; reload and see the same charts. Then every page at 1280x800 and 390x844 without
horizontal scrolling.
"""

import json
import re
import time
from pathlib import Path

import pytest

from .browser import (DESKTOP, PHONE, SHOTS, admin_password, chromium_browser, no_horizontal_scroll, open_page,
                      served, shot)

pytestmark = pytest.mark.slow

WORDS = ("kiln", "clay", "glaze", "fire")
EPOCHS = 50  # 4 records x 50 epochs = 200 steps: long enough to watch and stop, short enough for CI


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with served(tmp_path_factory, "kiln-dashboard-home", redis_db=14) as running:
        yield running


@pytest.fixture(scope="module")
def chromium(stack):
    with chromium_browser() as browser:
        yield browser


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "greetings.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {w}."},
                                                     {"role": "assistant", "content": f"{w.upper()}!"}]}) + "\n"
                            for w in WORDS))
    return path


def committed(page) -> int:
    return int(page.get_attribute("[data-job-page]", "data-committed"))


def chart_paths(page) -> list:
    return page.eval_on_selector_all("[data-chart] svg path",
                                     "paths => paths.map(p => [p.dataset.series, p.getAttribute('d')])")


def test_train_watch_stop_resume_and_reload(stack, chromium, dataset):
    from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

    SHOTS.mkdir(parents=True, exist_ok=True)
    for old in SHOTS.glob("*.png"):
        old.unlink()
    # waits for the worker (dispatch, model load, steps) on a busy 2-core host
    page = open_page(chromium, DESKTOP, timeout_ms=120_000)

    # sign in
    page.goto(stack.url + "/")
    assert "/accounts/login/" in page.url
    shot(page, "01-sign-in")
    page.fill("#id_username", "admin")
    page.fill("#id_password", admin_password(stack))
    page.click("button[type=submit]")
    page.wait_for_selector("text=Training jobs")
    shot(page, "02-jobs")

    # submit an SFT job from the form
    page.click("nav >> text=New job")
    page.fill("input[name=output_name]", "dash-bot")
    page.fill("input[name=epochs]", str(EPOCHS))
    # no checkpoint interval: the server's default (50) applies, so Stop and save saves without asking
    page.fill("input[name=seed]", "29")
    page.set_input_files("input[name=data]", str(dataset))
    shot(page, "03-new-job")
    sockets = []  # the page's WebSockets pass through here, so the test can cut one

    def forward(route):
        route.connect_to_server()  # messages flow both ways unchanged
        sockets.append(route)

    page.route_web_socket(re.compile(r"/ws/jobs/"), forward)

    def let_run(steps: int, past: int) -> None:
        """The run may go STEPS past step PAST and is held there (Stack.hold), so it cannot end before Stop."""
        stack.hold("dash-bot", step=past + steps)

    let_run(8, 0)
    page.click("button:has-text('Submit job')")
    page.wait_for_url(re.compile(r"/jobs/[0-9a-f-]{36}/$"))
    job_url = page.url
    job_id = job_url.rstrip("/").rsplit("/", 1)[1]

    # progress advances without a reload: the page keeps its own state object while it moves
    page.evaluate("window.__sameDocument = true")
    page.wait_for_function("Number(document.querySelector('[data-job-page]').dataset.committed) >= 3")
    first = committed(page)
    let_run(6, first)
    page.wait_for_function(f"Number(document.querySelector('[data-job-page]').dataset.committed) >= {first + 4}")
    assert page.evaluate("window.__sameDocument") is True
    assert page.inner_text("[data-live-indicator]") == "live"
    assert page.get_attribute("[data-chart=loss] path[data-series=run]", "data-points")
    assert re.fullmatch(r"Step \d+ of 200", page.inner_text("[data-progress-text]"))
    assert "left" in page.inner_text("[data-eta]")
    shot(page, "04-progress-live")

    # a dropped socket: the page reconnects with backoff, re-reads what it missed, and its chart has no gap
    dropped_at = committed(page)
    let_run(8, dropped_at)
    page.evaluate("""() => {  // every state the indicator takes, however briefly (a reconnect waits about 0.5 s)
        const indicator = document.querySelector('[data-live-indicator]');
        window.__states = [];
        new MutationObserver(() => window.__states.push(indicator.dataset.state))
            .observe(indicator, {attributes: true, attributeFilter: ['data-state']});
    }""")
    opened = len(sockets)
    sockets[-1].close(code=1012, reason="test drops the connection")
    page.wait_for_function("""() => {
        const states = window.__states, reconnecting = states.indexOf('reconnecting');
        return reconnecting >= 0 && states.indexOf('live', reconnecting) > reconnecting;
    }""")
    assert len(sockets) == opened + 1  # one new socket, through the same route
    page.wait_for_function(f"Number(document.querySelector('[data-job-page]').dataset.committed) >= {dropped_at + 5}")
    drawn_and_last = """() => [
        Number(document.querySelector('[data-chart=loss] path[data-series=run]').dataset.points),
        Number(document.querySelector('[data-job-page]').dataset.committed)]"""
    try:  # the resync lands (it is asked for again if the server was too busy to answer); the assert says why not
        page.wait_for_function(f"(([drawn, last]) => drawn === last)(({drawn_and_last})())")
    except PlaywrightTimeoutError:
        pass
    drawn, last = page.evaluate(drawn_and_last)
    assert drawn == last, f"the chart holds {drawn} steps of {last}: the resync after the reconnect missed some"
    assert page.evaluate("window.__sameDocument") is True

    # ... and on the jobs list, in a second tab
    listing = page.context.new_page()
    listing.goto(stack.url + "/")
    cell = f"tr[data-job='{job_id}'] [data-field=progress]"
    before = int(listing.inner_text(cell).split("/")[0])
    let_run(4, before)
    listing.wait_for_function(f"parseInt(document.querySelector(\"{cell}\").textContent) > {before}")
    shot(listing, "05-jobs-list-live")
    listing.close()

    # stop and save: the confirmed step is the checkpoint's, read back from the registry
    page.click("[data-stop]")
    page.wait_for_selector("[data-stop-state=confirmed]")
    stopped_at = int(page.get_attribute("[data-stop-state=confirmed]", "data-stop-step"))
    job = stack.client.job(job_id)
    assert job["status"] == "cancelled"
    assert job["latest_checkpoint"]["committed_step"] == job["progress"]["committed_step"] == stopped_at
    basename = job["latest_checkpoint"]["resume_checkpoint"]
    assert page.inner_text("[data-basename]") == basename
    assert page.inner_text("[data-resume-kind]") == "Exact resume"
    assert f"Stopped and saved at step {stopped_at} of 200" in page.inner_text("[data-panel=stop]")
    assert job["effective_config"]["checkpoint_interval"] == 50 and stopped_at < 50  # saved by the stop itself
    shot(page, "06-stopped-and-saved")
    stack.release("dash-bot")  # the resumed run goes to its end

    # prepare resume: prefilled, resume_checkpoint set, the inline data cleared
    page.click("[data-prepare-resume]")
    page.wait_for_selector("text=Prepare resume")
    assert page.input_value("input[name=resume_checkpoint]") == basename
    assert page.input_value("input[name=epochs]") == str(EPOCHS)
    assert page.input_value("input[name=seed]") == "29"
    assert page.input_value("input[name=data]") == ""
    shot(page, "07-prepare-resume")
    page.click("button:has-text('Submit resume')")
    page.wait_for_selector(".field-error")
    assert "Supply the training data again" in page.inner_text("[data-field=data] .field-error")
    assert stack.client.jobs()["count"] == 1
    shot(page, "08-refused-without-data")

    # supply the same data again and submit
    page.set_input_files("input[name=data]", str(dataset))
    page.click("button:has-text('Submit resume')")
    page.wait_for_url(re.compile(r"/jobs/[0-9a-f-]{36}/$"))
    assert page.url != job_url
    resumed_id = page.url.rstrip("/").rsplit("/", 1)[1]
    page.wait_for_function("document.querySelector('[data-job-page]').dataset.status === 'succeeded'")
    page.wait_for_selector("[data-trained=yes]")
    resumed = stack.client.job(resumed_id)
    assert resumed["resume_from"] == basename and resumed["progress"]["committed_step"] == 200
    assert page.inner_text("[data-progress-text]") == "Step 200 of 200"
    assert "Not requested" in page.inner_text("[data-promotion]")
    shot(page, "09-resumed-succeeded")

    # reload: the same charts, now drawn from the database alone
    live_paths = chart_paths(page)
    assert [series for series, _ in live_paths] == ["earlier", "run"] * 4  # loss, LR, gradient norm, tokens/s
    page.reload()
    page.wait_for_selector("[data-chart=loss] path[data-series=run]")
    assert chart_paths(page) == live_paths
    shot(page, "10-after-reload")
    assert not page.errors, page.errors

    # every page fits both viewports
    pages = {"jobs": "/", "job": f"/jobs/{resumed_id}/", "stopped-job": f"/jobs/{job_id}/",
             "new-job": "/jobs/new/sft/", "prepare-resume": f"/jobs/{job_id}/resume/", "adapters": "/adapters/",
             "adapter": "/adapters/dash-bot/"}
    for label, viewport in (("desktop", DESKTOP), ("phone", PHONE)):
        sized = chromium.new_context(viewport=viewport, storage_state=page.context.storage_state())
        view = sized.new_page()
        for name, path in pages.items():
            view.goto(stack.url + path)
            view.wait_for_load_state("networkidle")
            no_horizontal_scroll(view)
            if label == "phone" or name in ("adapters", "adapter"):
                shot(view, f"11-{label}-{name}")
        sized.close()
    anonymous = chromium.new_context(viewport=PHONE).new_page()
    anonymous.goto(stack.url + "/")
    no_horizontal_scroll(anonymous)
    anonymous.context.close()

    # a step pushed while the page's resync snapshot is on its way is kept: the committed step never
    # moves back to the snapshot's, so it matches the chart (held here; it raced under load before)
    held, racing = [], []
    race = page.context.new_page()
    race.route(re.compile(r"/jobs/[0-9a-f-]{36}/snapshot"), lambda route: held.append(route))
    race.route_web_socket(re.compile(r"/ws/jobs/"), lambda ws: (ws.connect_to_server(), racing.append(ws)))
    race.goto(f"{stack.url}/jobs/{resumed_id}/")
    deadline = time.monotonic() + 120
    while not (held and racing) and time.monotonic() < deadline:
        race.wait_for_timeout(50)  # lets Playwright deliver the route callbacks
    assert held and racing, (held, racing)
    points = """() => [
        Number(document.querySelector('[data-chart=loss] path[data-series=run]').dataset.points),
        Number(document.querySelector('[data-job-page]').dataset.committed)]"""
    drawn_before, final = race.evaluate(points)
    racing[-1].send(json.dumps({"type": "job.step", "job_id": resumed_id,
                                "metrics": {"step": final + 1, "loss": 0.5, "learning_rate": 0.0}}))
    race.wait_for_function(f"Number(document.querySelector('[data-job-page]').dataset.committed) === {final + 1}")
    assert race.get_attribute("[data-job-page]", "data-snapshots") == "0"  # the page's one snapshot is held
    held[0].continue_()
    race.wait_for_function("document.querySelector('[data-job-page]').dataset.snapshots === '1'")  # applied, drawn
    assert race.evaluate(points) == [drawn_before + 1, final + 1]
    assert not page.errors, page.errors
    page.context.close()
