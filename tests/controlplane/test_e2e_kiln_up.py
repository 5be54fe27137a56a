"""`kiln up` with no REDIS_URL runs jobs in its embedded worker; Ctrl-C cancels the running job
cooperatively (it publishes a checkpoint at the next step boundary), waits for it and exits cleanly."""

import json
import signal
import sqlite3

import pytest

from .services import Stack
from .services import sft_request as body

pytestmark = pytest.mark.slow


def test_ctrl_c_cancels_the_running_job_and_stops_cleanly(tmp_path):
    stack = Stack(tmp_path, redis_url=None)
    try:
        assert "embedded worker" in stack.web.output
        stack.hold("interrupted", step=3)
        job_id = stack.client.submit_sft(body("interrupted", epochs=250))["id"]
        stack.wait_held("interrupted", job_id)
        stack.web.popen.send_signal(signal.SIGINT)  # a stopping worker is not held
        assert stack.web.popen.wait(300) == 0, stack.web.output[-3000:]
        stack.web.wait_for("Kiln stopped", 300)  # the output thread drains the pipe
        assert f"cancelling job {job_id}" in stack.web.output
    finally:
        stack.stop()
    with sqlite3.connect(tmp_path / "kiln.sqlite3") as database:
        status, latest, step = database.execute(
            "SELECT status, latest_checkpoint, committed_step FROM jobs_trainingjob WHERE id = ?",
            (job_id.replace("-", ""),)).fetchone()
    assert status == "cancelled"
    latest = json.loads(latest)
    assert latest["committed_step"] == step >= 3 and latest["complete"] is False
    assert (tmp_path / "adapters" / latest["resume_checkpoint"] / "checkpoint_manifest.json").is_file()
