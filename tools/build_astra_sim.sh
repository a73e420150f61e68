#!/usr/bin/env bash
# Build ASTRA-sim's analytical network backends (congestion-unaware and congestion-aware) outside
# the repository, for `bench/astra.py` and the ET + configs `locus replay --chakra` writes.
#
#   tools/build_astra_sim.sh [--src DIR] [--mirror-root DIR] [--yaml-cpp DIR] [--out DIR] [--jobs N]
#
# Sources, one of:
#   (default)          git clone from GitHub at the pins below (needs network); the submodules
#                      the analytical build uses are checked out at the commits astra-sim pins.
#   --mirror-root DIR  local bare mirrors laid out as DIR/<owner>+<name>/repo (no network).
#                      Where a pinned submodule commit is missing from a mirror, the nearest
#                      commit that is there is used (SUBSTITUTES below).
#   --src DIR          an astra-sim tree whose extern/ submodules are already populated.
#   --yaml-cpp DIR     a yaml-cpp source tree handed to CMake's FetchContent
#                      (FETCHCONTENT_SOURCE_DIR_YAML-CPP) instead of a download.
#
# Output: $OUT/build/astra_analytical/build/bin/AstraSim_Analytical_Congestion_{Unaware,Aware}
# (OUT defaults to /work/astra). Point bench/astra.py at one with --astra-bin or ASTRA_SIM_BIN.
#
# Build dependencies (Debian/Ubuntu):
#   apt-get install -y cmake g++ protobuf-compiler libprotobuf-dev libboost-dev \
#       libboost-program-options-dev
#
# Pins (astra-sim 518bd51, 2026-03-25, "update ns3 submodule"; its .gitmodules pins in brackets):
#   astra-sim/astra-sim                518bd513 (HEAD of the snapshot used)
#   extern/graph_frontend/chakra       [0e3cd40c] astra-sim/chakra; substitute f37c2bb5 (branch
#                                      `stage`, 2025-04-17, "feederv3": the pin astra-sim used
#                                      before 0e3cd40, at 41fbd27 "update feeder commit")
#   extern/network_backend/analytical  [e8c5119f] astra-sim/astra-network-analytical; substitute
#                                      599a0473 (main, 2024-11-02, the pin before 2367f6f "Add yaml
#                                      package to the head repo"). 599a047 adds its own yaml-cpp
#                                      subdirectory, which clashes with the head repo's
#                                      FetchContent target: patched below to skip it when the
#                                      target exists.
#   extern/remote_memory_backend/analytical  641cce85 astra-sim/astra-memory-analytical (exact)
#   extern/helper/fmt                  7e73566c fmtlib/fmt (exact)
#   extern/helper/spdlog               [63f08750] gabime/spdlog; substitute 62302019 (branch v1.x,
#                                      2024-03-24)
#   yaml-cpp (FetchContent GIT_TAG)    a83cd31 jbeder/yaml-cpp (exact)
# The network mode uses the exact pins; the substitutes apply only where a pinned commit cannot be
# fetched.
set -euo pipefail

ASTRA_COMMIT=518bd513ae110428cd62eb60efc0f3993fd53c70
YAML_CPP_COMMIT=a83cd31548b19d50f3f983b069dceb4f4d50756d
OUT=/work/astra
SRC=""
MIRROR_ROOT=""
YAML_CPP_DIR=""
JOBS=2
while [[ $# -gt 0 ]]; do
  case "$1" in
    --src) SRC="$2"; shift 2 ;;
    --mirror-root) MIRROR_ROOT="$2"; shift 2 ;;
    --yaml-cpp) YAML_CPP_DIR="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --jobs) JOBS="$2"; shift 2 ;;
    -h|--help) sed -n '2,45p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done

# path  owner/name  pin  substitute
SUBMODULES=(
  "extern/graph_frontend/chakra astra-sim/chakra 0e3cd40c569f0a4cacb6d961bb56be53407abd2f f37c2bb50afa8b0e99b32ba9921662ab77502e85"
  "extern/network_backend/analytical astra-sim/astra-network-analytical e8c5119f8d5a690b955e25c37a74359f23ac64cc 599a0473a9a74f5383f73b3cea5a12b9bc5ebaef"
  "extern/remote_memory_backend/analytical astra-sim/astra-memory-analytical 641cce854d256bfd288b1de9607b6757313363f9 641cce854d256bfd288b1de9607b6757313363f9"
  "extern/helper/fmt fmtlib/fmt 7e73566ce7bd3617cd4b14a2e3a19a2a30b524c7 7e73566ce7bd3617cd4b14a2e3a19a2a30b524c7"
  "extern/helper/spdlog gabime/spdlog 63f0875000bf90867aa7c76a831bd834cb7d4b5e 62302019babd8fdf63c1c6dc4c9faa48d441a7f0"
)

# Export COMMIT of the bare mirror GITDIR into DEST; 1 when the commit is not in the mirror.
export_commit() {
  local gitdir="$1" commit="$2" dest="$3"
  git --git-dir="$gitdir" cat-file -e "${commit}^{commit}" 2>/dev/null || return 1
  rm -rf "$dest"; mkdir -p "$dest"
  # Snapshots may lack some blobs (large test data); leave those files out.
  local missing=()
  while IFS= read -r path; do
    missing+=(":(exclude)$path")
    echo "  $dest: $path is not in the mirror; left out" >&2
  done < <(git --git-dir="$gitdir" ls-tree -r "$commit" | awk -F'\t' '$1 ~ / blob / {print $2}' \
             | paste - <(git --git-dir="$gitdir" ls-tree -r "$commit" \
                           | awk '$2 == "blob" {print $3}' \
                           | git --git-dir="$gitdir" cat-file --batch-check) \
             | awk -F'\t' '$2 ~ / missing$/ {print $1}')
  git --git-dir="$gitdir" archive "$commit" -- . "${missing[@]}" | tar -x -C "$dest"
}

if [[ -z "$SRC" && -n "$MIRROR_ROOT" ]]; then
  SRC="$OUT/src/astra-sim"
  export_commit "$MIRROR_ROOT/astra-sim+astra-sim/repo" "$ASTRA_COMMIT" "$SRC"
  for entry in "${SUBMODULES[@]}"; do
    read -r path repo pin sub <<<"$entry"
    gitdir="$MIRROR_ROOT/${repo/\//+}/repo"
    if export_commit "$gitdir" "$pin" "$SRC/$path"; then
      echo "$path: $repo $pin (pinned)"
    elif export_commit "$gitdir" "$sub" "$SRC/$path"; then
      echo "$path: $repo $sub (pin $pin missing from the mirror; substitute)"
    else
      echo "$path: neither $pin nor $sub is in $gitdir" >&2; exit 1
    fi
  done
  if [[ -z "$YAML_CPP_DIR" ]]; then
    YAML_CPP_DIR="$OUT/src/yaml-cpp"
    export_commit "$MIRROR_ROOT/jbeder+yaml-cpp/repo" "$YAML_CPP_COMMIT" "$YAML_CPP_DIR"
  fi
elif [[ -z "$SRC" ]]; then
  SRC="$OUT/src/astra-sim"
  if [[ ! -d "$SRC/.git" ]]; then
    git clone https://github.com/astra-sim/astra-sim.git "$SRC"
  fi
  git -C "$SRC" checkout "$ASTRA_COMMIT"
  # Only the submodules the analytical build uses (ns-3 and htsim are large and not needed).
  paths=()
  for entry in "${SUBMODULES[@]}"; do read -r path _ <<<"$entry"; paths+=("$path"); done
  git -C "$SRC" submodule update --init --recursive "${paths[@]}"
fi

# The analytical backend at 599a047 adds extern/yaml-cpp itself; the head repo already declares the
# yaml-cpp target through FetchContent. Skip the second one (a no-op at the exact pin e8c5119).
ANA_CMAKE="$SRC/extern/network_backend/analytical/CMakeLists.txt"
if grep -q '^add_subdirectory(${CMAKE_CURRENT_SOURCE_DIR}/extern/yaml-cpp yaml-cpp)' "$ANA_CMAKE"; then
  sed -i 's|^add_subdirectory(${CMAKE_CURRENT_SOURCE_DIR}/extern/yaml-cpp yaml-cpp)|if (NOT TARGET yaml-cpp)\n    &\nendif ()|' "$ANA_CMAKE"
fi

# Chakra f37c2bb declares the ETFeeder alias inside Chakra::FeederV3; astra-sim 518bd51 names it
# Chakra::ETFeeder (the missing pin 0e3cd40 presumably declares it there). Add the alias at namespace
# Chakra when it is missing.
FEEDER_H="$SRC/extern/graph_frontend/chakra/src/feeder_v3/et_feeder.h"
after_ns=$(sed -n '/^} \/\/ namespace FeederV3/,$p' "$FEEDER_H")
if ! grep -q 'using ETFeeder = FeederV3::ETFeeder' <<<"$after_ns"; then
  sed -i '/^} \/\/ namespace FeederV3/{n;s|^} // namespace Chakra|using ETFeeder = FeederV3::ETFeeder;  // LOCUS_BUILD: Chakra::ETFeeder\n&|}' "$FEEDER_H"
  grep -q 'LOCUS_BUILD: Chakra::ETFeeder' "$FEEDER_H" || { echo "could not add the Chakra::ETFeeder alias" >&2; exit 1; }
fi

# Chakra's protobuf schema, compiled with the system protoc (what ASTRA-sim's build.sh does).
PROTO_DIR="$SRC/extern/graph_frontend/chakra/schema/protobuf"
protoc et_def.proto --proto_path="$PROTO_DIR" --cpp_out="$PROTO_DIR"

# The backend marks its targets COMPILE_WARNING_AS_ERROR; newer compilers warn where its CI did not.
CMAKE_ARGS=(-DBUILDTARGET=all -DCMAKE_BUILD_TYPE=Release --compile-no-warning-as-error)
if [[ -n "$YAML_CPP_DIR" ]]; then
  CMAKE_ARGS+=("-DFETCHCONTENT_SOURCE_DIR_YAML-CPP=$YAML_CPP_DIR")
fi
BUILD="$SRC/build/astra_analytical/build"
mkdir -p "$BUILD"
nice -n 10 cmake -S "$SRC/build/astra_analytical" -B "$BUILD" "${CMAKE_ARGS[@]}"
nice -n 10 cmake --build "$BUILD" -j "$JOBS"
ls -l "$BUILD"/bin/AstraSim_Analytical_Congestion_*
