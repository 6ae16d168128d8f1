#!/usr/bin/env bash
# The layering of the product's libraries holds: each library compiles against its own include
# folder (build/layers/<library>/), which must reach the layers below it and must not reach
# those above. Checked by preprocessing one header of each layer from each library's folder.
#   tests/cli/layers.sh TALON_BINARY SOURCE_DIR
set -euo pipefail
talon=$1 src=$2
root=$(cd "$(dirname "$talon")" && pwd)/layers
[ -d "$root" ] || { echo "FAIL: no $root (configure the build first)"; exit 1; }
# Lowest first; a header each layer owns.
layers=(talon_util talon_io talon_text talon_model talon_backend talon_data talon_draft talon_spec talon_cli)
headers=(util/error.h io/gguf.h text/tokenizer.h model/model.h backend/backend.h data/features.h draft/eagle3.h
         spec/speculate.h cli/commands/prepare.h)
# Which layers each may see (text and model are siblings: neither sees the other).
allowed() {
  case $1 in
    talon_util) echo "talon_util" ;;
    talon_io) echo "talon_util talon_io" ;;
    talon_text) echo "talon_util talon_io talon_text" ;;
    talon_model) echo "talon_util talon_io talon_model" ;;
    talon_backend) echo "talon_util talon_io talon_model talon_backend" ;;
    talon_data) echo "talon_util talon_io talon_text talon_model talon_backend talon_data" ;;
    talon_draft) echo "talon_util talon_io talon_text talon_model talon_backend talon_data talon_draft" ;;
    talon_spec) echo "talon_util talon_io talon_text talon_model talon_backend talon_data talon_draft talon_spec" ;;
    talon_cli) echo "${layers[*]}" ;;
  esac
}
fails=0 checks=0
for lib in "${layers[@]}"; do
  [ -d "$root/$lib" ] || { echo "FAIL: $root/$lib missing"; fails=$((fails + 1)); continue; }
  for i in "${!layers[@]}"; do
    h=${headers[$i]} owner=${layers[$i]}
    [ -f "$src/src/$h" ] || { echo "FAIL: $h does not exist"; fails=$((fails + 1)); continue; }
    checks=$((checks + 1))
    if [ -f "$root/$lib/$h" ]; then seen=1; else seen=0; fi
    if [[ " $(allowed "$lib") " == *" $owner "* ]]; then
      [ $seen = 1 ] || { echo "FAIL: $lib cannot include $h (layer $owner is below it)"; fails=$((fails + 1)); }
    else
      [ $seen = 0 ] || { echo "FAIL: $lib can include $h (layer $owner is not below it)"; fails=$((fails + 1)); }
    fi
  done
done
# Each product source is compiled with its layer's folder as the include path, not src/.
db=$(dirname "$talon")/compile_commands.json
if [ -f "$db" ]; then
  out=$(python3 - "$db" "$src" "$root" <<'PY'
import json, os, shlex, sys
db, src, root = sys.argv[1], os.path.realpath(sys.argv[2]), sys.argv[3]
owner = {"util": "talon_util", "io": "talon_io", "text": "talon_text", "model": "talon_model",
         "backend": "talon_backend", "data": "talon_data", "draft": "talon_draft", "spec": "talon_spec",
         "cli": "talon_cli"}
n = 0
for c in json.load(open(db)):
    f = os.path.realpath(c["file"])
    rel = os.path.relpath(f, os.path.join(src, "src"))
    if rel.startswith("..") or rel == os.path.join("cli", "main.cpp"):
        continue
    lib = owner[rel.split(os.sep)[0]]
    args = shlex.split(c.get("command") or " ".join(c["arguments"]))
    for i, a in enumerate(list(args)):  # nvcc takes its include paths from a response file
        if a == "--options-file" and i + 1 < len(args):
            args += shlex.split(open(os.path.join(c["directory"], args[i + 1])).read())
    incs = [a[2:] for a in args if a.startswith("-I")] + [args[i + 1] for i, a in enumerate(args) if a == "-I"]
    incs = [os.path.normpath(i) for i in incs]
    n += 1
    if os.path.normpath(os.path.join(root, lib)) not in incs:
        print(f"FAIL: {rel} is not compiled against {root}/{lib}")
    if os.path.normpath(os.path.join(src, "src")) in incs:
        print(f"FAIL: {rel} is compiled with src/ itself on its include path")
print(f"compile commands: {n} product sources checked")
PY
)
  echo "$out"
  fails=$((fails + $(grep -c '^FAIL' <<< "$out" || true)))
fi
[ $fails = 0 ] || { echo "FAIL: $fails of $checks layering checks"; exit 1; }
echo "PASS: $checks layering checks"
