"""bench/generate.py's Kiln side: on the serving threads' route (a thread of its own, OpenBLAS) and with an NF4 base
it generates what the same model generates in the calling thread (the route changes the products' library, not the
greedy tokens of this model), and records one time per call."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import generate as bench_generate  # noqa: E402

from trainer import DecoderOnlyTransformer  # noqa: E402
from trainer.generation import SamplingConfig  # noqa: E402


def test_the_serving_route_generates_the_same_greedy_tokens(tiny_config):
    model = DecoderOnlyTransformer(tiny_config())
    model.quantize(block_size=64)
    config = SamplingConfig(max_new_tokens=6, temperature=0)
    times = []
    here = bench_generate.kiln_generation(model, [1, 2, 3, 4], config, False, times)
    serving = bench_generate.kiln_generation(model, [1, 2, 3, 4], config, True, times)
    assert len(serving.tokens) == 6
    assert serving.tokens == here.tokens
    assert len(times) == 2 and all(t > 0 for t in times)
