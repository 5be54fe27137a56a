"""trainer.tensorfiles.safetensors_bytes: the same bytes for the same input, metadata included."""

import json
import struct
import subprocess
import sys

import numpy as np

from trainer.tensorfiles import safetensors_bytes

TENSORS = {"b": np.arange(6, dtype=np.float32).reshape(2, 3), "a": np.ones(5, np.float16)}
METADATA = {"format": "pt", "kiln.fused": json.dumps({"qkv_proj": ["q_proj", "v_proj"]}), "zeta": "é\n\"quoted\""}


def test_metadata_with_several_keys_serialises_the_same_every_time():
    """The safetensors library writes metadata from a hash map in a changing order (seen here: six orders in
    thirty calls); a PEFT export's bytes, and so a final adapter's digest, must not depend on it."""
    outputs = {safetensors_bytes(TENSORS, METADATA) for _ in range(30)}
    assert len(outputs) == 1
    data = outputs.pop()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    assert list(header["__metadata__"]) == sorted(METADATA) and header["__metadata__"] == METADATA
    from safetensors.numpy import load
    loaded = load(data)
    assert all(np.array_equal(loaded[k], v) for k, v in TENSORS.items())


def test_the_bytes_are_the_same_in_a_fresh_process():
    code = ("import sys, json, numpy as np; from trainer.tensorfiles import safetensors_bytes; "
            "sys.stdout.write(safetensors_bytes({'b': np.arange(6, dtype=np.float32).reshape(2, 3), "
            "'a': np.ones(5, np.float16)}, json.loads(sys.argv[1])).hex())")
    runs = {subprocess.run([sys.executable, "-c", code, json.dumps(METADATA)], capture_output=True, text=True,
                           check=True).stdout for _ in range(3)}
    assert runs == {safetensors_bytes(TENSORS, METADATA).hex()}
