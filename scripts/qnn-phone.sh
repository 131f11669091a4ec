#!/usr/bin/env bash
# Runs `leap qnn-selftest` on a Snapdragon phone's Hexagon NPU through adb.
#
# NOT TESTED: written from the public QNN docs (executorch's Qualcomm backend guide, the QNN
# SDK's backend page); this project's machines have no phone, no NDK and no aarch64 Rust std.
# What it shows that x86 cannot: real HTP numerics and timings (the x86 libQnnHtp.so is an
# emulator), the Stub/Skel FastRPC path, and whether the phone's SoC accepts the context
# binaries Leap caches.
#
# Needs:
#   QNN_SDK_ROOT   a Qualcomm AI Runtime (QAIRT) SDK, for the aarch64-android libraries and the
#                  Hexagon Skel library (they are Qualcomm's: not in this repository)
#   HTP_ARCH       the phone's Hexagon arch: v69, v73 (8 Gen 2), v75 (8 Gen 3), v79 (8 Elite), v81
#   a leap binary for Android: install the NDK and cargo-ndk, then
#     rustup target add aarch64-linux-android
#     cargo ndk -t arm64-v8a build --release -p leap-cli --features qnn
#   adb with one phone attached (USB debugging on)
set -euo pipefail

: "${QNN_SDK_ROOT:?set QNN_SDK_ROOT to a QAIRT SDK}"
arch="${HTP_ARCH:?set HTP_ARCH, e.g. v75}"
leap="${LEAP_ANDROID_BIN:-target/aarch64-linux-android/release/leap}"
dest=/data/local/tmp/leap-qnn
lib="$QNN_SDK_ROOT/lib/aarch64-android"
skel="$QNN_SDK_ROOT/lib/hexagon-$arch/unsigned/libQnnHtp${arch^^}Skel.so"

for f in "$leap" "$lib/libQnnHtp.so" "$lib/libQnnSystem.so" "$lib/libQnnHtpPrepare.so" \
         "$lib/libQnnHtp${arch^^}Stub.so" "$skel"; do
  [ -f "$f" ] || { echo "scripts/qnn-phone.sh: missing $f" >&2; exit 1; }
done

adb shell "mkdir -p $dest"
adb push "$leap" "$lib/libQnnHtp.so" "$lib/libQnnSystem.so" "$lib/libQnnHtpPrepare.so" \
  "$lib/libQnnHtp${arch^^}Stub.so" "$skel" "$dest/"
# llama.cpp's shared libraries, if leap was linked against them dynamically.
for so in target/aarch64-linux-android/release/*.so; do
  [ -f "$so" ] && adb push "$so" "$dest/"
done
# ADSP_LIBRARY_PATH tells the DSP loader where the Skel is (';'-separated).
adb shell "cd $dest && chmod +x leap && \
  LD_LIBRARY_PATH=$dest ADSP_LIBRARY_PATH='$dest;/vendor/lib/rfsa/adsp;/vendor/dsp/cdsp;/system/lib/rfsa/adsp;/dsp' \
  ./leap qnn-selftest --lib-dir $dest --graph-dir $dest/graphs --out $dest/qnn-selftest.json"
adb pull "$dest/qnn-selftest.json" "qnn-selftest-$arch.json"
# Run it twice: the second run's graphs come from the context binaries the first one saved.
echo "scripts/qnn-phone.sh: report in qnn-selftest-$arch.json" >&2
