#!/bin/sh
# The measurements behind docs/performance.md sections 1 to 4 (the demo,
# forward cost, batched decoding, cache share; raw output of earlier runs:
# docs/img/measurements_<commit>.txt), on a quiet machine with one thread:
#
#   scripts/measure_session.sh            # REWIND=path/to/rewind, OUT=dir
#
# Needs a Release build (build/tools/rewind). Writes the draft trained on the
# text alone (models/kjv-draft as of 6afde88, before distillation) to
# /tmp/old-draft and the 26M-parameter random hybrid of
# docs/img/random_26m_config.json, f16 and f32, to /tmp/m26 and /tmp/m26f32.
set -u
R=${REWIND:-build/tools/rewind}
OUT=${OUT:-/tmp/res}
mkdir -p $OUT
export OMP_NUM_THREADS=1
cd "$(dirname "$0")/.."
if [ ! -f /tmp/old-draft/model.safetensors ]; then
  mkdir -p /tmp/old-draft
  for f in config.json model.safetensors; do git show 6afde88:models/kjv-draft/$f > /tmp/old-draft/$f; done
fi
[ -f /tmp/m26/model.safetensors ] || $R init-random --config docs/img/random_26m_config.json --out /tmp/m26 --seed 3 --dtype f16
[ -f /tmp/m26f32/model.safetensors ] || $R init-random --config docs/img/random_26m_config.json --out /tmp/m26f32 --seed 3 --dtype f32
P="And it came to pass, when the king heard"
echo "== demo"; DEMO_REPEATS=5 scripts/demo.sh $R > $OUT/demo.txt 2>&1; tail -8 $OUT/demo.txt
for d in models/kjv-draft /tmp/old-draft; do
  for k in 2 3 4; do
    echo "== verify draft=$d K=$k"; $R verify --model models/kjv-hybrid --draft $d --num-draft $k --prompt "$P" --max-new-tokens 1000 --repeats 5 2>/dev/null
  done
  echo "== verify tree draft=$d"; $R verify --model models/kjv-hybrid --draft $d --tree 2 --tree-nodes 12 --num-draft 2 --prompt "$P" --max-new-tokens 1000 --repeats 5 2>/dev/null
done
for n in 2 3 4; do echo "== verify lookup K=$n"; $R verify --model models/kjv-hybrid --lookup 3 --num-draft $n --prompt "$P" --max-new-tokens 1000 --repeats 5 2>/dev/null; done
echo "== bench new draft"; $R bench --model models/kjv-hybrid --draft models/kjv-draft --k 2,3,4 --tree 2 --tree-nodes 12 --repeats 5 --max-new-tokens 200 --json $OUT/bench_new.json 2>/dev/null
echo "== bench old draft"; $R bench --model models/kjv-hybrid --draft /tmp/old-draft --k 2,3,4 --tree 2 --tree-nodes 12 --repeats 5 --max-new-tokens 200 --json $OUT/bench_old.json 2>/dev/null
for m in models/kjv-hybrid models/kjv-draft; do echo "== forward-cost $m"; $R forward-cost --model $m --samples 500 --max-q 8 2>/dev/null; done
for m in /tmp/m26 /tmp/m26f32; do echo "== forward-cost $m"; $R forward-cost --model $m --samples 30 --max-q 8 2>/dev/null; done
echo "== batch shipped"; $R bench --model models/kjv-hybrid --draft models/kjv-draft --k 2 --batch 1,2,4,8,16 --repeats 3 --max-new-tokens 200 --json $OUT/batch_kjv.json 2>/dev/null
echo "== batch 26m f16"; $R bench --model /tmp/m26 --k 2 --batch 1,4,16 --repeats 3 --max-new-tokens 100 --json $OUT/batch_26m_f16.json 2>/dev/null
echo "== batch 26m f32"; $R bench --model /tmp/m26f32 --k 2 --batch 1,4,16 --repeats 3 --max-new-tokens 100 --json $OUT/batch_26m_f32.json 2>/dev/null
echo done
