#!/usr/bin/env bash
# What a GPU machine without network needs beside the repository for gpu_session.py: the wheels of
# jaxpar's GPU path that its image lacks (tokamax 0.0.12 and its needs, tensorboardX; Python 3.12,
# x86-64) in .whl/, and nanoGPT's step in PyTorch in .gpu/. Both are git-ignored (.git/info/exclude).
#
#   bash scripts/tools/gpu_carry.sh [PATH/torch_gpt2_cuda.py]     # here, where pip reaches an index
#   # there, in the repository's root:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   PYTHONPATH=/tmp/site:$PWD python3 scripts/tools/gpu_session.py --out OUT --torch .gpu/torch_gpt2_cuda.py
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
WHEELS="tokamax==0.0.12 einshape pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection
typing_extensions>=4.16 qwix==0.1.8 immutabledict typeguard==2.13.3 tensorboardX"
mkdir -p .whl .gpu
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || printf '/.whl/\n/.gpu/\n' >> .git/info/exclude
# shellcheck disable=SC2086
"${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl $WHEELS
cp "${1:-../shared/gpu/torch_gpt2_cuda.py}" .gpu/torch_gpt2_cuda.py
ls .whl .gpu
