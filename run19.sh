#!/usr/bin/env bash
# early GPU check of the issue-19 integration
set -u
cd "$(dirname "$0")"
export OUT=${OUT:-/tmp/out}
bash scripts/gpu-check build > $OUT/gpucheck.txt 2>&1; tail -3 $OUT/gpucheck.txt
export EMSA_LIBRARY=$PWD/build-gpu/libemsa.so PYTHONPATH=$PWD/python
timeout 150 ./build-gpu/tests/emsa_tests --gtest_filter="${GF:-CudaRecipe*:HostTier*:CudaUpdate*:DeviceScalars*}" > $OUT/gtest.log 2>&1; echo "gtest rc=$?"
grep -E "^\[  (PASSED|FAILED)  \]|FAILED  \]" $OUT/gtest.log | head -30
timeout 120 ./build-gpu/tests/emsa_capi_c_test > $OUT/capi.log 2>&1; echo "capi rc=$?"; tail -2 $OUT/capi.log
timeout ${PYT:-240} python3 -m pytest -q -rf ${PYFILES:-tests/python/test_cuda_recipes.py} -p no:cacheprovider > $OUT/pytest.log 2>&1; echo "pytest rc=$?"
tail -30 $OUT/pytest.log
