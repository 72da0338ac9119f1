#!/usr/bin/env bash
# The smoke subset on the ends of the supported ranges (the full suite runs on .venv's torch 2.13):
#
#   bash tests/smoke/versions.sh torch==2.15.0 torch==2.8.0 transformers==5.17.0 transformers==5.25.0
#
# Each spec gets a virtual environment of its own, $FLASHDIST_VERSION_VENVS/<spec> (default .venv-versions/),
# made once and reused: it sees .venv's packages (launch/setup.sh makes .venv) through a path entry, with the
# spec installed over them. For a torch spec: the wheel built from this checkout installed there and
# tests/smoke/installed.py run away from the checkout (fused CPU step and host helper built from the installed
# files, DCP on 2 gloo ranks, the CLI), then $SMOKE_TESTS from the checkout. For a transformers spec (with
# the huggingface-hub etc. it needs, .venv's torch kept): $HF_SMOKE_TESTS and the Trainer's conformance
# cells. PyPI's torch for Linux x86-64 is the CUDA build: about 4 GB with its CUDA libraries, which a CPU
# machine downloads but does not use.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
# the base environment: .venv (made by launch/setup.sh), or the Python given as $FLASHDIST_PYTHON
PY=$(realpath -s "${FLASHDIST_PYTHON:-$(bash launch/setup.sh | tail -n 1)}")  # (-s: a venv's python links out of it)
VENVS=${FLASHDIST_VERSION_VENVS:-.venv-versions}
# the optimizer's API and quantization; the DCP reader's hook into torch's FileSystemReader (_slice_file)
SMOKE_TESTS=${SMOKE_TESTS:-tests/test_optimizer_api.py tests/test_quant.py \
  tests/security/test_bounded_parsing.py::test_a_tensor_record_that_would_inflate_is_refused_before_it_is_read}
# register() and the Trainer, from_pretrained of an exported folder; then the Trainer and PEFT conformance cells
HF_SMOKE_TESTS=${HF_SMOKE_TESTS:-tests/integrations/test_hf_trainer.py tests/integrations/test_hf_trainer_muon.py \
  tests/test_export_hf.py}
BASE_SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
[ $# -gt 0 ] || { echo "usage: $0 torch==X.Y.Z|transformers==X.Y.Z ..." >&2; exit 2; }

WHEEL_DIR=$(mktemp -d)
trap 'rm -rf "$WHEEL_DIR"' EXIT
mkdir -p "$WHEEL_DIR/src"
cp -r pyproject.toml README.md flashdist "$WHEEL_DIR/src/"
(cd "$WHEEL_DIR/src" && "$PY" -c "from setuptools import build_meta as b; import sys; out = sys.argv[1]; b.build_wheel(out)" \
  "$WHEEL_DIR/dist" >/dev/null)
WHEEL=$(ls "$WHEEL_DIR"/dist/*.whl)

for spec in "$@"; do
  name=${spec%%==*}
  venv=$(realpath -m "$VENVS/${spec/==/-}")
  if ! "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('$name').split('+')[0] != '${spec#*==}')" 2>/dev/null; then
    python3 -m venv --without-pip "$venv"
    echo "$BASE_SITE" > "$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/base.pth"
    # torch brings its own triton and CUDA libraries; transformers the huggingface-hub etc. it needs (5.25
    # needs huggingface-hub 2, which torchtitan's datasets pin keeps out of .venv), installed in this venv
    # over .venv's, with .venv's torch kept
    "$PY" -c "import torch; print('torch==' + torch.__version__)" > "$WHEEL_DIR/keep-torch.txt"
    deps=(); [ "$name" = torch ] || deps=(-c "$WHEEL_DIR/keep-torch.txt")
    # PIP_CONSTRAINT: a machine-wide constraint file may cap torch below the spec
    PIP_CONSTRAINT=/dev/null "$PY" -m pip --python "$venv/bin/python" install -q "${deps[@]}" "$spec"
  fi
  echo "== $spec ($venv)"
  case $name in
    torch)
      "$PY" -m pip --python "$venv/bin/python" install -q --no-deps --force-reinstall "$WHEEL"
      build=$(mktemp -d)
      (cd "$build" && env -u PYTHONPATH FLASHDIST_CPU_BUILD_DIR="$build/cpu" "$venv/bin/python" \
        "$ROOT/tests/smoke/installed.py" --source "$ROOT")
      rm -rf "$build"
      # the checkout's tests against the checkout's flashdist (first on the path, ahead of the installed wheel)
      PYTHONPATH="$ROOT" "$venv/bin/python" -m pytest -q -p no:cacheprovider $SMOKE_TESTS ;;
    transformers)
      PYTHONPATH="$ROOT" "$venv/bin/python" -m pytest -q -p no:cacheprovider $HF_SMOKE_TESTS
      PYTHONPATH="$ROOT" "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/conformance/test_matrix.py \
        -k "trainer" ;;
    *) echo "$0: $spec: give torch==X.Y.Z or transformers==X.Y.Z" >&2; exit 2 ;;
  esac
done
