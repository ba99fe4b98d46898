#!/usr/bin/env bash
# The bad inputs of the edges round in one soak: every case ends in its documented behaviour — a
# clear error naming what was expected and what was found (exit 1, or CLI11's validation exit for a
# flag it checks itself), or a run that says what it skipped — never a crash, a signal, a hang or
# a raw library message. Each case runs under a 20 s timeout; the whole soak takes a few seconds.
# Cases with their own tests elsewhere (the disk full: disk_full.sh; two runs in one folder:
# run_folder_lock.sh; a damaged checkpoint: resume.bad_checkpoints) are not repeated here.
# Usage: edges.sh TALLY IMAGES_DIR (tests/fixtures/images)
set -uo pipefail
tally=$(realpath "$1")
images=$(realpath "$2")
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
failures=0
cases=0

# expect NAME RC REGEX -- ARGS...: `tally ARGS` exits with RC (a number, or "error": 1 or CLI11's
# 105-109) and its output matches REGEX.
expect() {
  local name=$1 want=$2 regex=$3
  shift 4
  cases=$((cases + 1))
  local out rc t0=$SECONDS
  out=$(cd "$dir" && timeout --kill-after=5 20 "$tally" "$@" 2>&1)
  rc=$?
  local why=""
  if ((rc == 124 || rc == 137)); then
    why="timed out after 20 s"
  elif ((rc >= 128)); then
    why="died of signal $((rc - 128))"
  elif [[ $want == error ]] && ! ((rc == 1 || (rc >= 105 && rc <= 109))); then
    why="expected an error exit (1), found $rc"
  elif [[ $want != error && $rc != "$want" ]]; then
    why="expected exit $want, found $rc"
  elif ! grep -Eq -- "$regex" <<<"$out"; then
    why="output does not match /$regex/"
  elif grep -Eq "filesystem error|terminate called|Segmentation|Floating point exception|libgomp: Out of memory" <<<"$out"; then
    why="a raw library message"
  fi
  if [[ -n $why ]]; then
    failures=$((failures + 1))
    echo "FAIL $name: $why"
    echo "  tally $*"
    sed 's/^/  | /' <<<"$out" | tail -n 8
  else
    echo "ok   $name ($((SECONDS - t0)) s)"
  fi
}

plan=(plan --model resnet20 --no-layers)
train=(train --model resnet20 --batch-size 2 --steps 1 --no-progress --memory-limit 64MiB --threads 2)

# ---- limits a user gives: checked before any work, naming the flag ----------------------------------
expect workers error "--workers: must be a whole number from 0 to 256, found 100000" -- "${train[@]}" --workers 100000
expect "input beyond 2^31 values" error "--input 3x65536x65536: .* at most 2147483647" -- \
  "${plan[@]}" --input 3x65536x65536 --batch-size 1
expect "input of one huge side" error "--input 3x2147483648x2: .* at most 2147483647" -- \
  "${plan[@]}" --input 3x2147483648x2 --batch-size 1
expect "input of 10^10 pixels" error "--input 3x100000x100000: .* at most 2147483647" -- \
  "${plan[@]}" --input 3x100000x100000 --batch-size 1
expect "synthetic beyond 2^31" error "synthetic:3x65536x65536': .* at most 2147483647" -- \
  train --data synthetic:3x65536x65536 --steps 1
expect "memory limit 0" error "--memory-limit 0: size '0' is less than one byte" -- "${plan[@]}" --memory-limit 0
expect "host memory limit 0" error "--host-memory-limit: .*size '0' is less than one byte" -- \
  "${plan[@]}" --host-memory-limit 0
expect "23-digit size" error "--memory-limit 12345678901234567890123: .*beyond what 64 bits count" -- \
  "${plan[@]}" --memory-limit 12345678901234567890123
expect "size with a strange unit" error "--memory-limit 10 parsecs: invalid size '10 parsecs'" -- \
  "${plan[@]}" --memory-limit '10 parsecs'
expect "empty size" error "--memory-limit" -- "${plan[@]}" --memory-limit ''
expect "host tier beyond the machine: plan warns" 0 "warning: --host-memory-limit 100000TiB is more than this machine" -- \
  "${plan[@]}" --host-memory-limit 100000TiB
expect "host tier beyond the machine: train refuses" error "error: --host-memory-limit 100000TiB: this machine refused" -- \
  "${train[@]}" --no-eval --host-memory-limit 100000TiB
expect "compute rate too large" error "--compute-rate: .*1000000000\], found 1e300" -- "${plan[@]}" --compute-rate 1e300
expect "copy bandwidth denormal" error "--copy-bandwidth: .*found 4.9e-324" -- "${plan[@]}" --copy-bandwidth 4.9e-324
expect "learning rate too large" error "--lr: must be a number in \[0, 1000000\], found 1e\+308" -- \
  "${train[@]}" --lr 1e308
expect "learning rate not a number" error "--lr: must be a non-negative number, found fast" -- "${train[@]}" --lr fast
expect "zero batch" error "--batch-size" -- "${train[@]}" --batch-size 0
expect "zero steps" error "--steps" -- "${train[@]}" --steps 0

# ---- --recompute lists: the bad entry named ----------------------------------------------------------
recompute=("${plan[@]}" --host-memory-limit 1GiB --recompute)
expect "recompute: unknown mode" error "entry 1 'layer1.0=bogusmode': expected the mode keep, recompute or offload" -- \
  "${recompute[@]}" 'layer1.0=bogusmode'
expect "recompute: no mode" error "entry 1 'a' has no mode" -- "${recompute[@]}" 'a,,b'
expect "recompute: empty mode" error "entry 1 'layer1.0=': expected the mode" -- "${recompute[@]}" 'layer1.0='
expect "recompute: trailing comma" error "entry 2 is empty" -- "${recompute[@]}" 'layer1.0=offload,'
expect "recompute: space after a comma" error "entry 2 ' layer1.1=keep': expected a segment's name" -- \
  "${recompute[@]}" 'layer1.0=offload, layer1.1=keep'
expect "recompute: not a segment" error "'layer9.0' is not a segment of this model" -- "${recompute[@]}" 'layer9.0=offload'
expect "recompute: not a level" error "--recompute 'sometimes'" -- "${plan[@]}" --recompute sometimes

# ---- data sets and image folders ---------------------------------------------------------------------
expect "unknown data set" error "unknown data set 'bogus:x': expected one of .*folder:DIR" -- train --data bogus:x
f=$dir/f
mkdir -p "$f/train/a" "$f/train/b"
cp "$images/rgb.png" "$f/train/a/1.png"
cp "$images/rgb420.jpg" "$f/train/a/2.jpg"
cp "$images/rgb444.jpg" "$f/train/b/1.jpg"
cp "$images/progressive.jpg" "$f/train/b/2.jpg"
folder=("${train[@]}" --data "folder:$f")
expect "a good folder" 0 "2 classes, 4 training images.*no other files" -- "${folder[@]}" --input 3x16x16
expect "no evaluation set: said so" 0 "test set not evaluated \(no evaluation set\)" -- "${folder[@]}" --input 3x16x16
expect "folder without --input" error "expected --input CxHxW .*found none" -- "${folder[@]}"
expect "--num-classes with a folder" error "--num-classes 5 does not match folder:.*which has 2 classes" -- \
  "${folder[@]}" --input 3x16x16 --num-classes 5
expect "--max-image-pixels" error "declares 37 wide x 23 high = 851 pixels, more than the bound of 100 .*--max-image-pixels" -- \
  "${folder[@]}" --input 3x16x16 --max-image-pixels 100
expect "--transform none, wrong size" error "expected an image 16 wide and 16 high \(--input 3x16x16.*found one 37 wide and 23 high" -- \
  "${folder[@]}" --input 3x16x16 --transform none
ln -s self "$f/train/a/self"
expect "a symbolic link loop" error "found .*/train/a/self: too many levels of symbolic links" -- "${folder[@]}" --input 3x16x16
rm "$f/train/a/self"
ln -s nowhere.jpg "$f/train/a/dangling.jpg"
mkfifo "$f/train/b/fifo.jpg"
expect "a dangling link and a FIFO: counted" 0 "skipped: 1 broken symbolic link, 1 not a regular file" -- \
  "${folder[@]}" --input 3x16x16
rm "$f/train/a/dangling.jpg" "$f/train/b/fifo.jpg"
mkdir "$f/val"
expect "an empty val/" error "val: expected the evaluation set's images in class folders, found none" -- \
  "${folder[@]}" --input 3x16x16
rmdir "$f/val"
touch "$f/val"
expect "val as a file" error "val: expected the evaluation set, a folder of class folders of images, found something else" -- \
  "${folder[@]}" --input 3x16x16
rm "$f/val"
printf 'not a jpeg' >"$f/train/b/3.jpg"
expect "a corrupt image" error "train/b/3.jpg: " -- "${folder[@]}" --input 3x16x16
expect "a corrupt image skipped" 0 "train loss" -- "${folder[@]}" --input 3x16x16 --skip-bad-images
rm "$f/train/b/3.jpg"

# ---- plans without the GPU (tally plan --device-file; a build without CUDA says so instead) ---------
h200=$(realpath "$images/../devices/h200.json")
nocuda="|no CUDA backend"
expect "a device file for the CPU" error "--device-file: expected --device cuda \\(the file describes a GPU\\), found --device cpu$nocuda" -- \
  "${plan[@]}" --device cpu --device-file "$h200"
expect "a device file that is not there" error "device file '.*missing.json': cannot read it$nocuda" -- \
  "${plan[@]}" --device cuda --device-file "$dir/missing.json" --memory-limit 1GiB
printf '{"format": "tally device file", "version": 1}' >"$dir/half.json"
expect "a device file without its fields" error "device file '.*half.json': expected a field \"name\", found none$nocuda" -- \
  "${plan[@]}" --device cuda --device-file "$dir/half.json" --memory-limit 1GiB
expect "auto memory of a GPU not here" error "--memory-limit auto with --device-file: expected sizes .*NVIDIA H200 .* has 139.80 GiB$nocuda" -- \
  "${plan[@]}" --device cuda --device-file "$h200"
expect "a stage's auto memory of a GPU not here" error "--memory-limit 300MiB,auto with --device-file: expected sizes .*NVIDIA H200$nocuda" -- \
  "${plan[@]}" --device cuda --device-file "$h200" --pipeline-stages 2 --memory-limit 300MiB,auto
expect "rates of a GPU not here" error "expected --copy-bandwidth and --compute-rate as numbers .* found measure and measure$nocuda" -- \
  "${plan[@]}" --device cuda --device-file "$h200" --memory-limit 1GiB --host-memory-limit 1GiB
# The convolutions' tuning file (core/conv_tuning.h): an empty flag, a negative cap, a damaged file
# (read for the described GPU's plan, which replays it).
expect "an empty tuning file" error "--tuning-file" -- "${train[@]}" --tuning-file ""
expect "a negative tuning cap" error "--tuning-seconds" -- "${train[@]}" --tuning-seconds -1
printf '{"format": "tally convolution tuning", "version": 1, "devices": [' >"$dir/tuning.json"
expect "a damaged tuning file" error "tuning file '.*tuning.json': expected JSON written by tally.*--tuning-file none$nocuda" -- \
  "${plan[@]}" --device cuda --device-file "$h200" --memory-limit 1GiB --tuning-file "$dir/tuning.json"
if [[ $("$tally" --version) == *"GPU: none detected"* ]]; then  # on a GPU machine this plan is the GPU's
  expect "a GPU without its file" error "--device cuda: no GPU is present .*--device-file plans a GPU that is not here" -- \
    "${plan[@]}" --device cuda --memory-limit 1GiB
fi

echo "edges: $((cases - failures)) of $cases cases as documented, in $SECONDS s"
((failures == 0))
