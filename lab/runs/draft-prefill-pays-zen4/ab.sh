#!/bin/bash
# run-batch over the unique 200-request file: old (c0b643a) and new (HEAD) code alternating
F=/tmp/req200u.jsonl
T=qwen2.5-coder-1.5b-instruct:int4; D=qwen2.5-coder-0.5b-instruct:int4
one() { # $1 label $2 src
  rm -f /tmp/ab-$1.jsonl
  PYTHONPATH=$2 python -m specdecode.cli run-batch --input $F --output /tmp/ab-$1.jsonl --target $T --draft $D --quiet 2>&1 | grep "this run" | sed "s/^/$1: /"
}
for r in 1 2; do
  if [ $r = 1 ]; then one old /tmp/old/src; one new /work/main/src; else one new /work/main/src; one old /tmp/old/src; fi
done
