"""The process the crash tests kill: it publishes multi-file checkpoints until it dies or finishes.

Run as `python publish_worker.py REGISTRY FIRST_STEP LAST_STEP`: publish adapter
`crash-bot` at every step from FIRST_STEP to LAST_STEP (inclusive) with the deterministic
inputs of `checkpoint_inputs(step)`, printing `ready` once imported and `published STEP`
after each. With KILN_TEST_KILL_AT_STAGE=N it sends itself SIGKILL at the Nth publication
stage (counted from 0 across the run; stage names come from publish_checkpoint's
`on_stage`). The tests import this file for `checkpoint_inputs` and `load_module`.

checkpoint_dir.py is loaded by file path rather than through `trainer`, so that each of the
~40 processes a test kills starts in tens of milliseconds instead of importing the engine.
"""

import importlib.util
import os
import random
import signal
import sys
from pathlib import Path

ADAPTER = "crash-bot"
MODULE_PATH = Path(__file__).resolve().parents[2] / "trainer" / "runs" / "checkpoint_dir.py"


def load_module():
    spec = importlib.util.spec_from_file_location("kiln_checkpoint_dir_worker", MODULE_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def checkpoint_inputs(step: int) -> tuple[dict, dict]:
    """(files, manifest) of one step: four files (one nested), 3.5 MiB in all, identical on every call."""
    rng = random.Random(step)
    files = {
        "adapter.safetensors": rng.randbytes(1 << 20),
        "optimizer.safetensors": rng.randbytes(5 << 19),
        "rng/streams.json": b'{"python": %d}' % rng.getrandbits(64),
        "state.json": b'{"step": %d}' % step,
    }
    manifest = {"seed": 1234, "config": {"epochs": 3, "learning_rate": 1e-4},
                "progress": {"committed_step": step, "total_steps": 10 ** 6, "complete": False,
                             "next_cursor": {"epoch": 0, "example": step * 2}, "data_source_kind": "inline"},
                "loss_history": [1.0 / (i + 1) for i in range(step)]}
    return files, manifest


def main(argv):
    registry, first, last = Path(argv[1]), int(argv[2]), int(argv[3])
    module = load_module()
    kill_at = os.environ.get("KILN_TEST_KILL_AT_STAGE")
    count = [0]

    def on_stage(name):
        if kill_at is not None and count[0] == int(kill_at):
            os.kill(os.getpid(), signal.SIGKILL)
        count[0] += 1

    print("ready", flush=True)
    for step in range(first, last + 1):
        files, manifest = checkpoint_inputs(step)
        module.publish_checkpoint(registry, ADAPTER, step, checkpoint_type="sft", files=files,
                                  manifest=manifest, on_stage=on_stage)
        print(f"published {step}", flush=True)


if __name__ == "__main__":
    main(sys.argv)
