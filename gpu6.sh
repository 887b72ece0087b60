#!/bin/bash
# GPU call 6: the XLA pass that crashes compiling the 2-GPU MLA step (tiny shapes).
export NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD JTBO_CACHE_DIR=/tmp/jtbo-cache
which gdb
TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=hlo_pass_pipeline=1,gpu_compiler=1 timeout 60 python3 -X faulthandler -m jtbo.bench tbo --devices 2 --mla --tiny --prefill 256 --decode --iters 3 --no-profile > $OUT/vlog.log 2>&1
echo "rc=$?"
grep -n "Running HLO pass\|HLO pass\|pass:" $OUT/vlog.log | tail -5 | cut -c1-250
grep -v "^I1130" $OUT/vlog.log | grep -B2 -A6 "Fatal" | cut -c1-200 | head -12
tail -c 3000 $OUT/vlog.log | grep "^I1130" | tail -6 | cut -c1-250
