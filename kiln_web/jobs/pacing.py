"""Test-only pacing of a run (KILN_TEST_PACE_DIR, unset in every deployment): a fault or end-to-end test holds
a worker's run at a point it names and lets it go, so the fault lands mid-run by construction however fast
or loaded the machine is.

The gate for adapter A is the file `<dir>/A`, JSON:
- `{"step": N}` holds the run once step N is committed and its checkpoint (if one is due) published:
  the worker waits before recording step N+1;
- `{"step": N, "stage": S}` holds it inside the publication of the step-N checkpoint, right after stage S
  of `trainer.runs.checkpoint_dir.publish_checkpoint` (e.g. "manifest": files written, not yet renamed).
While held, the worker writes `<dir>/A.held` ({"step", "stage"}) and removes it when released. Removing or
rewriting the gate releases the run; so does cancelling the job or stopping the worker.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

POLL_SECONDS = 0.02


class Pace:
    """The gate of one running job; `released` is asked while held (True: cancelled or stopping)."""

    def __init__(self, directory: str, adapter: str, released):
        self.gate = Path(directory) / adapter
        self.held = Path(directory) / f"{adapter}.held"
        self.released = released
        self.step = 0  # the last committed step

    def before_step(self, step: int) -> None:
        """Called before STEP is recorded: held while the gate says to stop after an earlier step."""
        self._hold(lambda gate: "stage" not in gate and step > gate["step"], {"step": step - 1, "stage": None})
        self.step = step

    def at_stage(self, stage: str) -> None:
        """Called after each stage of a checkpoint publication at the last committed step."""
        self._hold(lambda gate: gate.get("stage") == stage and gate["step"] == self.step,
                   {"step": self.step, "stage": stage})

    def _gate(self) -> dict | None:
        try:
            gate = json.loads(self.gate.read_text())
        except (FileNotFoundError, ValueError):  # absent, or being rewritten: not held
            return None
        return gate if isinstance(gate, dict) and isinstance(gate.get("step"), int) else None

    def _hold(self, holds, where: dict) -> None:
        marked = False
        try:
            while (gate := self._gate()) is not None and holds(gate) and not self.released():
                if not marked:
                    temporary = self.held.with_name(self.held.name + ".tmp")
                    temporary.write_text(json.dumps(where))
                    os.replace(temporary, self.held)
                    marked = True
                time.sleep(POLL_SECONDS)
        finally:
            if marked:
                self.held.unlink(missing_ok=True)
