# Sourced by the ab_*.sh scripts: the nvcc flags of the harnesses ($flags) and the variants to time:
# names=(base ...) and dirs=(csrc ...), one copy of csrc under /tmp/ab per patch given ("$@": git
# diffs against the repository root; one that does not apply is reported and left out).
source bench/harness/nvcc_flags.sh
names=(base) dirs=(csrc)
for patch in "$@"; do
  name=$(basename "$patch" .patch) dir=/tmp/ab/$name
  rm -rf "$dir" && mkdir -p "$dir" && cp -r csrc "$dir/"
  if patch -s -p1 -d "$dir" < "$patch"; then names+=("$name") dirs+=("$dir/csrc"); else echo "$name: patch failed"; fi
done
