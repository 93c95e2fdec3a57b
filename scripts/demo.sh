#!/bin/sh
# `make demo`: speculative decoding with the shipped KJV models.
#
#   scripts/demo.sh REWIND_BINARY
#
# Streams a speculative continuation of $DEMO_PROMPT by models/kjv-hybrid
# drafted by models/kjv-draft, then runs `rewind verify` (greedy and
# speculative decoding of the same tokens, compared token by token) and
# prints tokens/s side by side with the acceptance rate. Environment:
# DEMO_PROMPT, DEMO_TOKENS (new tokens shown, default 300), DEMO_TIMING_TOKENS
# (new tokens of the timed runs, default 1000), DEMO_REPEATS (timed runs of
# each method, alternating; medians are shown, default 5), DEMO_DRAFT_K
# (draft tokens per round, default 4), DEMO_TREE_WIDTH / DEMO_TREE_NODES /
# DEMO_TREE_DEPTH (the tree row: children per node, node budget, depth;
# default 2, 12, 2), OMP_NUM_THREADS (default 1: on a
# shared or small machine one thread per forward gives the steadiest
# timings).
set -eu
REWIND=${1:?usage: scripts/demo.sh path/to/rewind}
TARGET=models/kjv-hybrid
DRAFT=models/kjv-draft
PROMPT=${DEMO_PROMPT:-"And it came to pass, when the king heard"}
TOKENS=${DEMO_TOKENS:-300}
TIMED=${DEMO_TIMING_TOKENS:-1000}
REPEATS=${DEMO_REPEATS:-5}
K=${DEMO_DRAFT_K:-4}
TREE_W=${DEMO_TREE_WIDTH:-2}
TREE_N=${DEMO_TREE_NODES:-12}
TREE_K=${DEMO_TREE_DEPTH:-2}
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

params() { "$REWIND" inspect --model "$1" | sed -n 's/^parameters: //p'; }
echo "== rewind demo: $TARGET ($(params $TARGET) parameters) drafted by $DRAFT ($(params $DRAFT) parameters)"
echo "== greedy speculative decoding (K = $K), $TOKENS new bytes; the text equals plain greedy decoding's:"
echo
printf '%s' "$PROMPT"
"$REWIND" generate --model "$TARGET" --draft "$DRAFT" --num-draft "$K" --prompt "$PROMPT" --max-new-tokens "$TOKENS"
echo
echo "== timing: plain greedy vs speculative decoding of the same $TIMED tokens (rewind verify, medians of $REPEATS runs)"
line=$("$REWIND" verify --model "$TARGET" --draft "$DRAFT" --num-draft "$K" --prompt "$PROMPT" --max-new-tokens "$TIMED" --repeats "$REPEATS" 2>/dev/null) || {
  echo "$line"
  echo "demo: speculative decoding diverged from greedy decoding" >&2
  exit 1
}
lookup=$("$REWIND" verify --model "$TARGET" --lookup 3 --prompt "$PROMPT" --max-new-tokens "$TIMED" --repeats "$REPEATS" 2>/dev/null) || {
  echo "$lookup"
  echo "demo: prompt-lookup decoding diverged from greedy decoding" >&2
  exit 1
}
tree=$("$REWIND" verify --model "$TARGET" --draft "$DRAFT" --tree "$TREE_W" --tree-nodes "$TREE_N" --num-draft "$TREE_K" \
  --prompt "$PROMPT" --max-new-tokens "$TIMED" --repeats "$REPEATS" 2>/dev/null) || {
  echo "$tree"
  echo "demo: tree speculative decoding diverged from greedy decoding" >&2
  exit 1
}
# Lines look like "IDENTICAL: N new tokens; greedy G tok/s, speculative S tok/s
# (Rx), acceptance A (a/d), ..."
field() { echo "$1" | sed -n "s|.*$2.*|\\1|p"; }
g=$(field "$line" 'greedy \([0-9.]*\) tok/s')
s=$(field "$line" 'speculative \([0-9.]*\) tok/s')
r=$(field "$line" '(\([0-9.]*x\))')
a=$(field "$line" 'acceptance \([0-9.]*\)')
ls=$(field "$lookup" 'speculative \([0-9.]*\) tok/s')
lr=$(field "$lookup" '(\([0-9.]*x\))')
la=$(field "$lookup" 'acceptance \([0-9.]*\)')
ts=$(field "$tree" 'speculative \([0-9.]*\) tok/s')
tr=$(field "$tree" '(\([0-9.]*x\))')
ta=$(field "$tree" 'acceptance \([0-9.]*\)')
n=$(field "$line" 'IDENTICAL: \([0-9]*\) new')
printf '   %-34s %10s %9s %11s\n' "decoding" "tokens/s" "speedup" "acceptance"
printf '   %-34s %10s %9s %11s\n' "greedy (target alone)" "$g" "1.00x" "-"
printf '   %-34s %10s %9s %11s\n' "chain, draft model (K=$K)" "$s" "$r" "$a"
printf '   %-34s %10s %9s %11s\n' "chain, prompt lookup (n=3)" "$ls" "$lr" "$la"
printf '   %-34s %10s %9s %11s\n' "tree, draft model (W=$TREE_W, <=$TREE_N, K=$TREE_K)" "$ts" "$tr" "$ta"
echo "   every run produced the same $n tokens as greedy decoding (IDENTICAL); OMP_NUM_THREADS=$OMP_NUM_THREADS"
