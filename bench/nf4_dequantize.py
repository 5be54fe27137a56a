"""The NF4 dequantizer's inner loop, each version this CPU can run, in its own process: ns per element.

Dequantizing the frozen base is the one cost a QLoRA step has beyond a LoRA step's work (every
projection's tiles, forward and input gradient: about 212 million elements per step for the
SmolLM2-135M shape). Versions (native_ext/nf4.h, chosen once per process, KILN_NF4_PAIRS names one):
portable (a table lookup per element), avx2 (two register permutes and a blend per 8 elements),
avx512 (one register permute per 16); the default is the widest this CPU has. All give the same bytes
(tests/engine/test_quantization.py).

    python bench/nf4_dequantize.py [--rows 3072] [--cols 576] [--repeats 30]
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = {"portable": None, "avx2": "avx2", "avx512": "avx512f"}


def child(rows, cols, repeats):
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from trainer.quantization import dequantize_rows, quantize_nf4

    weight = np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32)
    result = {}
    for double in (False, True):
        tensor = quantize_nf4(weight, block_size=64, double_quantization=double)
        out = np.empty((rows, cols), np.float32)
        dequantize_rows(tensor, 0, rows, out)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            dequantize_rows(tensor, 0, rows, out)
            best = min(best, time.perf_counter() - start)
        result["double" if double else "single"] = best / (rows * cols) * 1e9
    print(json.dumps(result))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=3072)
    parser.add_argument("--cols", type=int, default=576)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.rows, args.cols, args.repeats)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import cpu, describe

    print(describe())
    print(f"NF4 block 64, a [{args.rows}, {args.cols}] weight dequantized whole, best of {args.repeats}")
    print(f"{'version':10s} {'ns/element':>11s} {'double quant.':>14s}")
    flags = cpu()[1]
    for version, flag in VERSIONS.items():
        if flag is not None and flag not in flags:
            print(f"{version:10s} skipped: this CPU has no {flag}")
            continue
        out = subprocess.run([sys.executable, __file__, "--child", "--rows", str(args.rows), "--cols", str(args.cols),
                              "--repeats", str(args.repeats)], capture_output=True, text=True, check=True,
                             env={**os.environ, "KILN_NF4_PAIRS": version})
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{version:10s} {r['single']:11.3f} {r['double']:14.3f}")


if __name__ == "__main__":
    main()
