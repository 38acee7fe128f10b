# /tmp/old: a git worktree of the code before (7aa28bd^); /tmp/cg_qa.jsonl: the code_generation, chat and
# question_answering lines of lab/runs/hybrid-heldout-amx/prompts.jsonl
cd /work/main
D=qwen2.5-coder-0.5b-instruct:int4
for r in 1 2; do
  for side in old new; do
    if [ $side = old ]; then P=/tmp/old/src; else P=/work/main/src; fi
    PYTHONPATH=$P python -c "import sys; from specdecode.cli import main; sys.argv[0]='specdecode'; main()" bench --target qwen2.5-coder-1.5b-instruct:int4 --draft $D --draft $D+suffix --methods ar,spec --k 4 --prompts /tmp/cg_qa.jsonl --chat --max-new-tokens 64 --out /work/main/lab/runs/hybrid-depth-zen4/$side-$r > /dev/null 2>&1
    echo "=== $side round $r"
    sed -n '/## Speedup by category/,/## Best k/p' lab/runs/hybrid-depth-zen4/$side-$r/report.md | grep -E "^\| (code|chat|question|all)"
  done
done
