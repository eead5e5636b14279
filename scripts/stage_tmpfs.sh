#!/usr/bin/env bash
# Stage a dataset onto a RAM-backed tmpfs from the shell (needs root for mount).
#
#   sudo scripts/stage_tmpfs.sh SRC MOUNTPOINT SIZE     e.g. /data/imagenet /mnt/ramdisk 160G
#
# Mounts a tmpfs of SIZE at MOUNTPOINT (unless one is already mounted there), refuses when
# SRC does not fit in it or in available RAM (tmpfs pages are RAM; they may go to swap),
# copies SRC into MOUNTPOINT/<name of SRC> with rsync (atomically: into a hidden folder,
# renamed when complete), and prints the /etc/fstab line for a permanent mount (with the size
# it is mounted with; none for /dev/shm, which the system mounts) and the train.py overrides to
# use it. Then train with:
#   python train.py dataset.root=MOUNTPOINT/<name> storage=disk
# (or storage=tmpfs storage.target_dir=MOUNTPOINT to let fastload stage and verify it).
set -euo pipefail

usage() { echo "usage: $0 SRC MOUNTPOINT SIZE   (SIZE as mount -o size=: 30G, 512M, 50%)" >&2; exit 2; }
[[ $# -eq 3 ]] || usage
src=$(realpath -e "$1") || { echo "error: source $1 does not exist" >&2; exit 2; }
mnt=$2
size=$3
name=$(basename "$src")

command -v rsync >/dev/null || { echo "error: rsync not found: apt-get install rsync (or dnf install rsync)" >&2; exit 2; }

need_kb=$(du -sk --apparent-size "$src" | cut -f1)
need_kb=$(( need_kb + need_kb / 50 + 1024 ))  # + 2 % for page rounding + 1 MB

mkdir -p "$mnt"
reused=0
if mountpoint -q "$mnt"; then
  fstype=$(stat -f -c %T "$mnt")
  [[ $fstype == tmpfs ]] || { echo "error: $mnt is already a $fstype mount, not tmpfs" >&2; exit 2; }
  reused=1
  size_kb=$(df -k --output=size "$mnt" | tail -1 | tr -d ' ')
  echo "$mnt: tmpfs already mounted, reusing it ($((size_kb / 1024)) MB; SIZE $size is not applied)"
else
  [[ $(id -u) -eq 0 ]] || { echo "error: mounting needs root: sudo $0 $*" >&2; exit 2; }
  mount -t tmpfs -o "size=$size,mode=1777" tmpfs "$mnt"
  echo "mounted: mount -t tmpfs -o size=$size tmpfs $mnt"
fi

# The copy is made with rsync --delete over MOUNTPOINT/<name>: a folder there that this script
# did not stage (no .stage-complete) may be someone's data, and SRC itself must not be it.
if [[ -e "$mnt/$name" && $(realpath -e "$mnt/$name") == "$src" ]]; then
  echo "error: $src is already at $mnt/$name: nothing to stage" >&2; exit 2
fi
if [[ -e "$mnt/$name" && ! -f "$mnt/$name/.stage-complete" ]]; then
  echo "error: $mnt/$name exists and is not a copy staged by this script (no .stage-complete in it);" >&2
  echo "staging would replace it. Move it away, or stage into another MOUNTPOINT." >&2
  exit 2
fi
if [[ -f "$mnt/$name/.stage-complete" ]]; then
  echo "$mnt/$name: complete earlier staging found; rsync updates only what changed"
fi
free_kb=$(df -k --output=avail "$mnt" | tail -1 | tr -d ' ')
have_kb=$(du -sk "$mnt/$name" 2>/dev/null | cut -f1 || echo 0)
ram_kb=$(awk '/MemAvailable/ {print $2}' /proc/meminfo)
if (( need_kb - have_kb > free_kb )); then
  echo "error: $src needs $((need_kb / 1024)) MB, $mnt has $((free_kb / 1024)) MB free." >&2
  echo "fix: remount bigger: mount -o remount,size=<N>G $mnt" >&2
  exit 1
fi
if (( need_kb - have_kb > ram_kb )); then
  echo "error: $src needs $((need_kb / 1024)) MB but only $((ram_kb / 1024)) MB of RAM is available;" >&2
  echo "a tmpfs that large would push data (or your training job) into swap. Use a subset or a packed store (python -m fastload.pack shards ...)." >&2
  exit 1
fi

work="$mnt/.staging-$name"
if [[ -d "$mnt/$name" && ! -d "$work" ]]; then mv "$mnt/$name" "$work"; fi  # update in place
rm -f "$work/.stage-complete"
rsync -a --info=progress2 --delete "$src/" "$work/"
touch "$work/.stage-complete"
rm -rf "$mnt/$name.old"; [[ -d "$mnt/$name" ]] && mv "$mnt/$name" "$mnt/$name.old"
mv "$work" "$mnt/$name"
rm -rf "$mnt/$name.old"
echo "staged $src -> $mnt/$name ($(du -sh "$mnt/$name" | cut -f1))"
echo
if [[ $(realpath "$mnt") == /dev/shm ]]; then
  # The system mounts /dev/shm; an fstab line with SIZE could shrink it below what it has.
  echo "permanent mount: none needed, the system mounts /dev/shm (resize it with"
  echo "  mount -o remount,size=<N>G /dev/shm, or docker run --shm-size=<N>g)"
elif (( reused )); then
  if command -v findmnt >/dev/null && findmnt --fstab -n --mountpoint "$mnt" >/dev/null; then
    echo "permanent mount: $mnt is in /etc/fstab already"
  else
    echo "permanent mount: add this line to /etc/fstab (the size it is mounted with now)"
    echo "  tmpfs  $mnt  tmpfs  size=${size_kb}k,mode=$(stat -c %a "$mnt")  0  0"
  fi
else
  echo "permanent mount: add this line to /etc/fstab"
  echo "  tmpfs  $mnt  tmpfs  size=$size,mode=1777  0  0"
fi
echo "train from it:"
echo "  python train.py dataset.root=$mnt/$name storage=disk"
