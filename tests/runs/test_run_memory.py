"""What a run holds while it trains, measured with tracemalloc in a fresh interpreter: a dataset file's bytes and
its parsed records are read to check the admitted digest and to tokenize, then let go; only the tokenized
examples (cut to max_sequence_length) stay for the run's length."""

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

SFT_HELD = r"""
import json, sys, tracemalloc
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from test_sft import make_settings, request
from trainer.runs.sft import admit_sft, run_sft

home = Path(sys.argv[1])
settings = make_settings(home)
path = home / "datasets" / "long.jsonl"
filler = "lorem ipsum dolor sit amet " * 400  # about 10.8 kB a record; each example is cut to 32 tokens
with open(path, "w") as handle:
    for i in range(400):
        handle.write(json.dumps({"prompt": f"Record {i}:", "completion": filler}) + "\n")
admission = admit_sft(request(str(path), epochs=1, max_sequence_length=32), settings)


class Hooks:
    held = None

    def on_step(self, metrics):
        if self.held is None:
            self.held = tracemalloc.get_traced_memory()[0]

    def should_cancel(self):
        return self.held is not None

    def on_checkpoint(self, *args):
        pass

    def on_event(self, *args):
        pass


hooks = Hooks()
tracemalloc.start()
run_sft(admission, settings, hooks)
print(json.dumps({"file_bytes": path.stat().st_size, "held": hooks.held}))
"""


def test_an_sft_run_does_not_hold_its_dataset_file_while_it_trains(tmp_path):
    # before: the run kept the file's bytes and every parsed record to its end (2.2x the file at the first step)
    done = subprocess.run([sys.executable, "-c", SFT_HELD, str(tmp_path), str(HERE)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured["held"] < measured["file_bytes"] * 0.5, measured


SFT_ADMISSION_PEAK = r"""
import json, sys, tracemalloc
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from test_sft import make_settings, request
from trainer.runs.sft import admit_sft

home = Path(sys.argv[1])
settings = make_settings(home)
path = home / "datasets" / "long.jsonl"
filler = "lorem ipsum dolor sit amet " * 400
with open(path, "w") as handle:
    for i in range(400):
        handle.write(json.dumps({"prompt": f"Record {i}:", "completion": filler}) + "\n")
tracemalloc.start()
admit_sft(request(str(path), epochs=1, max_sequence_length=32), settings)
print(json.dumps({"file_bytes": path.stat().st_size, "peak": tracemalloc.get_traced_memory()[1]}))
"""


def test_sft_admission_reads_a_dataset_file_without_a_list_of_its_lines(tmp_path):
    # the file's bytes, its text and its records are needed at once; a list of every line beside them was a fourth
    # copy (peak 4.2x the file before, 3.2x after)
    done = subprocess.run([sys.executable, "-c", SFT_ADMISSION_PEAK, str(tmp_path), str(HERE)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured["peak"] < measured["file_bytes"] * 3.6, measured
