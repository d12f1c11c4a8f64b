#!/usr/bin/env bash
# DeepSpeed, and what it needs that the GPU machine's image lacks, as wheels in .whl/ (ignored by
# git) for the device tool's `carry`, so a visit can run DeepSpeed's modes with nothing to fetch:
#
#     bash benchmarks/peer_wheels.sh
#     # then the device command starts with
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#         --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit;
#
# The image has DeepSpeed's other needs (einops, msgpack, ninja, numpy, psutil, py-cpuinfo, tqdm,
# and scipy for DeepCompile) but not hjson or pydantic. Its Python is 3.12 on x86-64, so the
# binary one (pydantic-core) is fetched for that, whatever this machine runs. DeepSpeed publishes
# sources only: its wheel is built here, pure Python (its C++/CUDA ops build at first use there,
# with the image's nvcc and ninja). Versions: those the CPU runs in docs/results/ used.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir .whl
export PIP_CONFIG_FILE=/dev/null  # this machine's pip configuration is not the GPU image's
python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 \
    typing-inspection==0.4.2 typing-extensions==4.16.0
ls -l .whl
