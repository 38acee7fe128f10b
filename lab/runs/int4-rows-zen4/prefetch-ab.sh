cd /work/main
f=src/specdecode/kernels/linear_avx512.cpp
cp $f /tmp/linear_avx512.orig
for r in 1 2; do
  for V in 4096 8192 16384 2048; do
    cp /tmp/linear_avx512.orig $f
    sed -i "278s/pg + 4096 + 64 \* line/pg + $V + 64 * line/" $f
    echo "=== round $r: int4 tile prefetch $V bytes ahead"
    python lab/probes/int4_rows.py --skip v,prefill --rows 1,3,5,8,12,24 2>&1 | grep "rows:"
  done
done
cp /tmp/linear_avx512.orig $f
