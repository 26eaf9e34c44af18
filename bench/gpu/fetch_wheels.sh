#!/usr/bin/env bash
# Fill bench/gpu/wheels with the wheels the GPU image lacks, for the Pythons it may have
# (run here, where PyPI is reachable; the folder travels with the tree to the GPU machine).
set -eu
cd "$(dirname "$0")"
for v in 3.10 3.11 3.12 3.13; do
  python3 -m pip download -q --only-binary=:all: --python-version "$v" --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 -d wheels pydantic pyyaml
done
ls wheels
