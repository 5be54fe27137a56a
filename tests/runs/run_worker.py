"""Runs one training job in its own process (for kill tests): python run_worker.py job.json

job.json: {"kind": "sft" | "grpo" | "opd", "home": KILN_HOME, "request": {...}}. KILN_TEST_STEP_DELAY
(seconds) slows each committed step so the parent can kill the process mid-run.
"""

import json
import os
import sys
import time
from pathlib import Path

from trainer.runs import grpo, opd, sft
from trainer.runs.common import RunSettings

RUNS = {"sft": (sft.admit_sft, sft.run_sft), "grpo": (grpo.admit_grpo, grpo.run_grpo),
        "opd": (opd.admit_opd, opd.run_opd)}


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
    admit, run = RUNS[spec["kind"]]
    result = run(admit(spec["request"], settings), settings,
                 SlowHooks(float(os.environ.get("KILN_TEST_STEP_DELAY", "0"))))
    print(json.dumps({"status": result.status, "steps": result.steps_completed}))


if __name__ == "__main__":
    main()
