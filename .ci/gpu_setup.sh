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
if [ -d .va ] && [ ! -d /tmp/vd/av ]; then  # PyAV, where the image lacks it (the tests' video records)
    python3 -c "import av" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/vd .va/*.whl
fi
if [ -d .vr1 ]; then cp .vr1/* /tmp/vr/; fi
if [ -d .vr2 ]; then cp .vr2/* /tmp/vr/; fi
if [ -f /tmp/vr/rayp_aa ] && [ -f /tmp/vr/rayp_ab ] && [ ! -d /tmp/vd/ray ]; then
    cat /tmp/vr/rayp_aa /tmp/vr/rayp_ab > "/tmp/vr/$(cat /tmp/vr/name)"
    python3 -m pip install -q --no-index --no-deps --target /tmp/vd "/tmp/vr/$(cat /tmp/vr/name)"
fi
if [ -d .vs ] && [ ! -f /tmp/vs/.done ]; then  # Ray Serve's dependencies, after the image's own on sys.path
    python3 -m pip install -q --no-index --no-deps --target /tmp/vs .vs/*.whl && touch /tmp/vs/.done
    echo /tmp/vs > "$(python3 -c 'import site; print(site.getsitepackages()[0])')/zz-ray-serve-deps.pth"
    # Ray Serve's gRPC reflection needs a newer grpcio than the image's (1.84 in Nov 2026): that one goes first
    mkdir -p /tmp/vg && ln -sf /tmp/vs/grpc /tmp/vg/grpc && ln -sf /tmp/vs/grpcio-*.dist-info /tmp/vg/
fi
if [ -d /tmp/vg ]; then export PYTHONPATH="/tmp/vg${PYTHONPATH:+:$PYTHONPATH}"; fi
_src=""
for _p in rl-core rl-models rl-rollout rl-policy rl-data rl-rewards; do _src="$_src:$PWD/packages/$_p/src"; done
export PYTHONPATH="/tmp/vd$_src${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
unset _src _p
