# Developer tool (source it on the GPU machine, from the repository root): installs what
# .ci/gpu_carry.sh packed and this call carried into /tmp/vd, and sets PYTHONPATH to it and to
# the workspace packages' sources. Ray's pure dependencies go in only where the image lacks them.
mkdir -p /tmp/vd /tmp/vr
if [ -d .vd ] && [ ! -f /tmp/vd/.done ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/vd .vd/*.whl && touch /tmp/vd/.done
    python3 - <<'PY'
import glob
import importlib.util
import subprocess
import sys

module = {"click": "click", "filelock": "filelock", "jsonschema": "jsonschema", "referencing": "referencing",
          "jsonschema_specifications": "jsonschema_specifications", "rpds_py": "rpds", "attrs": "attrs",
          "msgpack": "msgpack", "protobuf": "google.protobuf", "pyyaml": "yaml", "requests": "requests"}


def present(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


missing = [w for w in glob.glob(".vd/opt/*.whl") if not present(module[w.split("/")[-1].split("-")[0].lower()])]
if missing:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", "/tmp/vd",
                    *missing], check=True)
print("installed into /tmp/vd; Ray's dependencies the image lacked:", [m.split("/")[-1] for m in missing])
PY
fi
[ -d .vr1 ] && cp .vr1/* /tmp/vr/
[ -d .vr2 ] && cp .vr2/* /tmp/vr/
if [ -f /tmp/vr/rayp_aa ] && [ -f /tmp/vr/rayp_ab ] && [ ! -d /tmp/vd/ray ]; then
    cat /tmp/vr/rayp_aa /tmp/vr/rayp_ab > "/tmp/vr/$(cat /tmp/vr/name)"
    python3 -m pip install -q --no-index --no-deps --target /tmp/vd "/tmp/vr/$(cat /tmp/vr/name)"
fi
_src=""
for _p in rl-core rl-models rl-rollout rl-data rl-rewards; do _src="$_src:$PWD/packages/$_p/src"; done
export PYTHONPATH="/tmp/vd$_src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
unset _src _p
