#!/usr/bin/env bash
# The checks to run first whenever a CUDA machine is at hand, in one go of about 4 minutes:
#
#   bash benchmarks/gpu_check.sh [OUTDIR]      # OUTDIR: default $OUT, else ./gpu-check
#
# 1. the CUDA tests (tests/test_cuda.py, tests/test_found_on_gpu.py) and the tests of the
#    accelerator path's late reads (tests/test_deferred_*.py), now on a real device, alone
#    on it (some hold the GPU busy for 100 ms and expect the host to be faster);
# 2. the failure gallery with its tensors on CUDA, in watch and in sentinel mode: where
#    nanwatch's answer differs from each scenario's EXPECTED (benchmarks/gallery_device.py);
# 3. the stream tests of test_cuda.py with the wait for the user's stream switched off:
#    the [forward] case and the update's case must fail (they prove the wait is needed),
#    the [step] case passes either way ("2 failed, 1 passed");
# 4. the GPU benchmark (benchmarks/gpu.py) at batch 16 and 64, after 1 and 2, on a GPU
#    nothing else is using: RESULTS-GPU.md and the raw cells go to OUTDIR.
#
# It installs nanwatch over the torch already there (no dependency is resolved: a machine
# without the package registries can run it). Each part has its own time limit and the
# script goes on when one fails; the summary at the end says what each gave.
set -u
out="${1:-${OUT:-gpu-check}}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"

# at most 8 files come back from a lent machine: the logs below, RESULTS-GPU.md, gpu.json
"$py" -m pip install -q --no-deps --no-build-isolation -e . >/tmp/nanwatch-install.log 2>&1 ||
  { echo "install failed (running from the source tree):"; tail -5 /tmp/nanwatch-install.log; }
"$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" | tee "$out/device.txt"
if ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device here: nothing to check (tests/test_cuda.py skips on CPU-only machines)"
  exit 1
fi

timeout 240 "$py" -m pytest -q -p no:cacheprovider -o addopts="" -rfE \
  tests/test_cuda.py tests/test_found_on_gpu.py tests/test_deferred_path.py \
  tests/test_deferred_loss_code.py tests/test_deferred_late_context.py >"$out/tests.log" 2>&1
echo "rc=$?" >>"$out/tests.log"
for mode in watch sentinel; do
  (
    timeout 200 "$py" -m benchmarks.gallery_device cuda --mode "$mode" \
      >"$out/gallery-$mode.log" 2>&1
    echo "rc=$?" >>"$out/gallery-$mode.log"
  ) &
done
wait

# the stream tests must fail with the wait for the user's stream switched off: they can
(
  timeout 120 "$py" -c "
import sys, pytest, nanwatch.watcher as w
w.note_stream = lambda device: None
sys.exit(pytest.main(['-q', '-rA', '-p', 'no:cacheprovider', '-o', 'addopts=',
                      'tests/test_cuda.py', '-k', 'stream_of_its_own or update_on_a_stream']))" \
    >"$out/streams-off.log" 2>&1
  echo "rc=$?" >>"$out/streams-off.log"
)

timeout 300 "$py" -m benchmarks.gpu --batches 16,64 --out "$out/RESULTS-GPU.md" \
  --json "$out/gpu.json" >"$out/gpu.log" 2>&1
echo "rc=$?" >>"$out/gpu.log"

echo "== tests";            grep -E "passed|failed|^FAILED|^ERROR|^rc=" "$out/tests.log" | tail -8
for mode in watch sentinel; do
  echo "== gallery on cuda, $mode"; tail -25 "$out/gallery-$mode.log"
done
echo "== stream tests with the wait off (must be: [step] PASSED, [forward] and the update FAILED)"
grep -E "^(PASSED|FAILED)|passed|failed|^rc=" "$out/streams-off.log" | tail -6
echo "== GPU benchmark";    grep -E "x[0-9]|^rc=" "$out/gpu.log" | tail -20
