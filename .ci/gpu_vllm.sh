#!/usr/bin/env bash
# Developer tool, not part of CI: vLLM on the GPU machine, which cannot reach a package index and
# takes at most 64 MiB a call. The wheel set is built by the team's gpu-wheels/bundle.sh into
# eight parts of at most 50 MiB.
#
#   here:   bash .ci/gpu_vllm.sh prepare BUNDLE_DIR    # hardlinks BUNDLE_DIR/parts/partNN into .vpN/ (ignored)
#   there:  bash .ci/gpu_vllm.sh install               # one call per part, carry [".vpN"], back to back
#                                                      # (the machine is kept ~30 s between calls)
# The call that brings the eighth part unpacks them and installs the set into /tmp/vsite (~15 s);
# then, in each call: source .ci/gpu_setup.sh; export PYTHONPATH=/tmp/vsite:$PYTHONPATH
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
prepare)
    parts="${2:?usage: gpu_vllm.sh prepare BUNDLE_DIR}/parts"
    i=0
    for part in "$parts"/part*; do
        mkdir -p ".vp$i" && ln -f "$part" ".vp$i/"
        grep -qxF ".vp$i/" .git/info/exclude 2>/dev/null || echo ".vp$i/" >> .git/info/exclude
        i=$((i + 1))
    done
    echo "$i parts in .vp0 .. .vp$((i - 1)): carry one per call"
    ;;
install)
    mkdir -p /tmp/vl
    cp .vp*/part* /tmp/vl/ 2>/dev/null || true
    echo "parts here: $(ls /tmp/vl | tr '\n' ' ')"
    if [ "$(ls /tmp/vl | wc -l)" -ge 8 ] && [ ! -d /tmp/vsite/vllm ]; then
        cat /tmp/vl/part* | tar -x -C /tmp
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/vsite /tmp/vset/*.whl
        echo "vLLM installed in /tmp/vsite"
    fi
    ;;
*)
    sed -n '2,10p' "$0"
    exit 2
    ;;
esac
