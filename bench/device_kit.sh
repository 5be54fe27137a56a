#!/usr/bin/env bash
# Prepares .whl/ for bench/cuda_check.sh on a GPU machine that cannot reach a package index: the Python 3.12
# manylinux x86_64 wheels of what Kiln needs there beyond what that machine's image already holds (its image has
# PyTorch with CUDA, transformers, peft, numpy, Cython, safetensors, tokenizers, jinja2, pytest, hypothesis,
# threadpoolctl and nvidia-cublas; /work/.library/device/KINDS.md lists it). Run it here, where pip reaches the
# registry, then on the GPU machine carry .whl and run bench/cuda_check.sh, which installs them first:
#   bench/device_kit.sh && echo /.whl/ >> .git/info/exclude
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
PLATFORMS=()
for tag in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 \
        manylinux_2_5 manylinux1; do
    PLATFORMS+=(--platform "${tag}_x86_64")
done
TARGET=(--python-version 3.12 --implementation cp --only-binary=:all: "${PLATFORMS[@]}")
# what the GPU tests import beyond the image: the web stack (pytest-django loads the settings), the GGUF reader
WANTED=("django>=5.0" "django-ninja>=1.3" "channels>=4.1" "channels-redis>=4.2" "celery>=5.4" "redis>=5.0"
        "psycopg[binary]>=3.2" "dj-database-url>=2.1" "gguf>=0.10.0" "pytest-django>=4.8" "uvicorn>=0.30")
# on the image already (lower-case names), so not carried
HAS=" numpy pyyaml pygments attrs certifi charset-normalizer click idna iniconfig packaging pluggy pytest
 python-dateutil requests six tqdm typing-extensions urllib3 msgpack h11 anyio jinja2 markupsafe safetensors
 tokenizers threadpoolctl hypothesis sortedcontainers filelock fsspec "
report="$(mktemp)"
"$PY" -m pip install --quiet --dry-run --ignore-installed --target "$(mktemp -d)" --report "$report" "${TARGET[@]}" \
    "${WANTED[@]}"
mapfile -t needed < <("$PY" - "$report" "$HAS" <<'PY'
import json, sys
has = set(sys.argv[2].split())
for item in json.load(open(sys.argv[1]))["install"]:
    name = item["metadata"]["name"].lower().replace("_", "-")
    if name not in has:
        print(f"{item['metadata']['name']}=={item['metadata']['version']}")
PY
)
rm -rf .whl && mkdir -p .whl
"$PY" -m pip download --quiet --no-deps -d .whl "${TARGET[@]}" "${needed[@]}"
echo "device_kit: ${#needed[@]} wheels, $(du -sh .whl | cut -f1) in .whl/ (the device call carries at most 64 MiB in all)"
