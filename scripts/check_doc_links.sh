#!/usr/bin/env bash
# Checks that the documentation points at files that exist:
#   - every relative markdown link, [text](path) or ![alt](path), in
#     README.md, CHANGELOG.md and docs/*.md resolves (relative to the file
#     that holds it; a #fragment is dropped, http(s)/mailto links and pure
#     #anchors are skipped);
#   - every repository path quoted in backticks in those files, such as
#     `docs/semantics.md` or `examples/quickstart.cc`, exists (paths under the
#     source folders only; globs, braces and placeholders are left alone; a
#     runtime header may be quoted as included, `runtime/model.h`).
#
#   scripts/check_doc_links.sh        # exit 1 and one line per broken reference
set -euo pipefail
cd "$(dirname "$0")/.."

files=(README.md CHANGELOG.md docs/*.md)
roots='docs|examples|scripts|include|src|runtime|tools|tests|bench|fuzz|models|python|cmake'
broken=0

for f in "${files[@]}"; do
  [ -f "$f" ] || continue
  dir=$(dirname "$f")
  # Markdown links: the target between "](" and the next ")" or space.
  while IFS=: read -r line target; do
    target=${target%%#*}
    case "$target" in
      '' | http://* | https://* | mailto:*) continue ;;
    esac
    if [ ! -e "$dir/$target" ]; then
      echo "$f:$line: link to '$target' ($dir/$target does not exist)"
      broken=1
    fi
  done < <(grep -no '!\?\[[^]]*\]([^) ]*' "$f" | sed -E 's/^([0-9]+):.*\]\(/\1:/')
  # Repository paths in backticks, relative to the repository root.
  while IFS=: read -r line path; do
    case "$path" in
      *'*'* | *'{'* | *'<'* | *'...'* | *'X'.'Y'*) continue ;;
    esac
    path=${path%%#*}
    path=${path%/}
    # Headers are quoted as they are included: runtime/model.h is
    # runtime/include/runtime/model.h.
    if [ ! -e "$path" ] && [ ! -e "runtime/include/$path" ]; then
      echo "$f:$line: '$path' does not exist"
      broken=1
    fi
  done < <(grep -noE "\`($roots)/[A-Za-z0-9_./*{},<>+-]*\`" "$f" | sed -E 's/^([0-9]+):`(.*)`$/\1:\2/')
done

if [ "$broken" = 0 ]; then
  echo "check_doc_links: every link and quoted path in ${#files[@]} files resolves"
fi
exit "$broken"
