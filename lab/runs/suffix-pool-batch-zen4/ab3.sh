#!/bin/bash
# after the time curve: B A over the :int4 target, then B A over bfloat16
set -x
OUT=/work/main/lab/runs/suffix-pool-batch-zen4
run() {  # side target label
  if [ "$1" = old ]; then dir=/tmp/old; else dir=/work/main; fi
  (cd $dir && PYTHONPATH=$dir/src python -m benchmarks.suffix_pool --target $2 --requests 32 --batch 8 --out $OUT/$3-$1-$4) > $OUT/$3-$1-$4.log 2>&1
  grep "whole job" $OUT/$3-$1-$4/pool.md
}
T=qwen2.5-coder-1.5b-instruct
run new $T:int4 int4 b4; run old $T:int4 int4 a4
run new $T bf16 b3; run old $T bf16 a3
echo DONE
