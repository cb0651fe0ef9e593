#!/usr/bin/env bash
# Developer tool, not part of CI: builds the folders a GPU-machine call carries (the device tool
# sends at most 64 MiB a call and the machine has no package index), from this machine's index.
#
#   bash .ci/gpu_carry.sh            # .vd/ (diffusers, datasets, msgspec, ... + Ray's pure deps in .vd/opt),
#                                    # .vr1/ and .vr2/ (the Ray wheel in two parts), .va/ (PyAV: video records)
#   bash .ci/gpu_carry.sh serve      # the same and .vs/: Ray Serve's dependencies (~43 MB; a call of its own)
#   then on the GPU machine, in each call:   source .ci/gpu_setup.sh
#
# Carry [".vd", ".vr1"] in one call and [".vr2"] in the next (back to back: the machine is kept
# ~30 s between calls); gpu_setup.sh installs what arrived into /tmp/vd (kept for the lease) and
# joins the Ray parts once both are there. The folders are listed in .git/info/exclude.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
get() {  # get DIR PACKAGE...: CPython 3.12 x86_64 wheels, no dependencies
    local dir=$1; shift
    mkdir -p "$dir"
    "$PY" -m pip download --quiet --no-deps --only-binary :all: --python-version 3.12 \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        -d "$dir" "$@"
}
get .vd diffusers==0.42.1 datasets dill multiprocess msgspec rapidfuzz starlette uvicorn httptools
get .vd/opt click filelock jsonschema jsonschema-specifications referencing rpds-py attrs msgpack protobuf pyyaml requests
RAY=$(sed -n '/^name = "ray"$/{n;s/version = "\(.*\)"/\1/p}' uv.lock)
tmp=$(mktemp -d)
get "$tmp" "ray==$RAY"
mkdir -p .vr1 .vr2
(cd "$tmp" && split -b 40M ray-*.whl rayp_ && basename ray-*.whl > name)
cp "$tmp/rayp_aa" "$tmp/name" .vr1/ && cp "$tmp/rayp_ab" .vr2/
rm -rf "$tmp"
mkdir -p .va && get .va "av==$(sed -n '/^name = "av"$/{n;s/version = "\(.*\)"/\1/p}' uv.lock | tail -1)"  # PyAV (~35 MB): a call of its own
if [ "${1:-}" = serve ]; then  # ray[serve]'s dependency closure for CPython 3.12, less Ray and numpy
    get_all() { "$PY" -m pip download --quiet --only-binary :all: --python-version 3.12 --platform manylinux2014_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64 -d .vs "$@"; }
    mkdir -p .vs && get_all "ray[serve]==$RAY" && rm -f .vs/ray-*.whl .vs/numpy-*.whl
fi
mkdir -p .git/info && for d in .vd/ .vr1/ .vr2/ .vs/ .va/ .vq/ .vp/; do
    grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done
du -sh .vd .vr1 .vr2 .vs .va 2>/dev/null || true
