"""trainer.runtime: the heap keeps a step's freed activations for the next step, and gives them back on request."""

import subprocess
import sys
import textwrap

import pytest

from trainer import DecoderOnlyTransformer, TransformerConfig, model as model_module, runtime

pytestmark = pytest.mark.skipif(runtime._libc() is None, reason="not glibc: its allocator keeps its own defaults")

# 80 blocks of 16 MiB from the heap (glibc would map each afresh by default); together 1.25 GiB, above
# the 1 GiB trim threshold Kiln used before, where glibc gave the freed top back and the next step faulted it in
CHILD = textwrap.dedent("""
    import json, os
    import numpy as np
    from trainer import runtime

    def resident_mib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    tuned = runtime.tune_allocator()
    blocks = [np.ones(4 << 20, np.float32) for _ in range(80)]
    held = resident_mib()
    del blocks
    freed = resident_mib()
    released = runtime.release_memory()
    print(json.dumps({"tuned": tuned, "held": held, "freed": freed, "released": released,
                      "after": resident_mib()}))
""")


def test_freed_heap_stays_for_reuse_until_released():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    import json
    r = json.loads(out.stdout)
    assert r["tuned"] is True
    assert r["held"] > 1200
    assert r["freed"] > r["held"] - 50, "glibc trimmed the heap on free: the next step would fault it all in again"
    assert r["released"] is True
    assert r["after"] < r["freed"] - 1000


# a block above glibc's largest possible mmap threshold, 32 MiB (the fused loss's logits chunk is about 64 MiB):
# freed and asked for again, it comes back from the heap with its pages mapped, not from a fresh mmap whose every
# page faults in
LARGE_CHILD = textwrap.dedent("""
    import json, resource
    import numpy as np
    from trainer import runtime

    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    runtime.tune_allocator()
    first = np.ones(16 << 20, np.float32)  # 64 MiB
    del first
    before = faults()
    second = np.ones(16 << 20, np.float32)
    print(json.dumps({"faults": faults() - before}))
""")


def test_a_large_block_freed_and_asked_for_again_faults_no_pages_in():
    out = subprocess.run([sys.executable, "-c", LARGE_CHILD], capture_output=True, text=True, check=True)
    import json
    faults = json.loads(out.stdout)["faults"]
    assert faults < 16, f"{faults} page faults: the block was unmapped on free and mapped afresh"


def test_closing_a_model_releases_the_free_heap(monkeypatch):
    calls = []
    monkeypatch.setattr(model_module, "release_memory", lambda: calls.append(True) or True)
    config = TransformerConfig(vocabulary_size=8, maximum_context=4, model_width=8, head_count=2, block_count=1,
                               feed_forward_width=16)
    with DecoderOnlyTransformer(config):
        assert calls == []
    assert calls == [True]
