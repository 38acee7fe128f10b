# /tmp/old: a git worktree of the code before (eea9f4c)
# /work/main (new): eea9f4c with wide-tile.diff applied (not kept)
cd /work/main
for r in 1 2; do
  for side in old new; do
    if [ $side = old ]; then P=/tmp/old/src; else P=/work/main/src; fi
    echo "=== round $r: $side"
    PYTHONPATH=$P python lab/probes/int4_rows.py --rows 1,12,16,24,32,64,512 --tokens 1,8,12,16,24,32,64 --repeats 3 2>&1 | grep -v "Loading\|building"
  done
done
