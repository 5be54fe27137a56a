"""Runs one SFT job in its own process (for kill tests): python sft_worker.py job.json

job.json: {"home": KILN_HOME, "request": {...}}. KILN_TEST_STEP_DELAY (seconds) slows each
committed step so the parent can kill the process mid-run.
"""

import json
import os
import sys
import time
from pathlib import Path

from trainer.runs.sft import RunSettings, admit_sft, run_sft


class SlowHooks:
    def __init__(self, delay):
        self.delay = delay

    def on_step(self, metrics):
        time.sleep(self.delay)

    def should_cancel(self):
        return False

    def on_checkpoint(self, summary, timing):
        pass

    def on_event(self, level, message):
        pass


def main():
    spec = json.loads(Path(sys.argv[1]).read_text())
    home = Path(spec["home"])
    settings = RunSettings(home=home, registry=home / "adapters", bases_root=home,
                           data_roots=(home / "datasets",))
    admission = admit_sft(spec["request"], settings)
    result = run_sft(admission, settings, SlowHooks(float(os.environ.get("KILN_TEST_STEP_DELAY", "0"))))
    print(json.dumps({"status": result.status, "steps": result.steps_completed}))


if __name__ == "__main__":
    main()
