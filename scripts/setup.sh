#!/usr/bin/env bash
# Installs Ferry's build and test dependencies from Debian packages. Idempotent.
# As root it runs apt-get; otherwise it prints the command to run.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  clang libclang-rt-14-dev            # libFuzzer + sanitizer runtimes for the fuzz targets
  nlohmann-json3-dev libcli11-dev libre2-dev
  libxxhash-dev librocksdb-dev libzmq3-dev cppzmq-dev libsodium-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  libtorch-dev                        # legacy adapter_model.bin reader, GRPO daemon
  libopenblas0-openmp                 # BLAS for LibTorch (the default reference BLAS is ~15x slower)
  libtomlplusplus-dev                 # ferryd's TOML configuration
  libcurl4-openssl-dev                # HTTP to a vLLM server (sync/engine)
  python3 python3-venv curl           # scripts/vllm.sh: the real vLLM the engine tests run against
  libgloo-dev                         # Gloo's headers for c10d's ProcessGroupGloo (ferryd data-parallel)
  iproute2                            # tests: data-parallel ranks in network namespaces of their own
  libonig-dev libicu-dev              # tokenizer.json pre-tokenizer regexes (as HF tokenizers) and NFC
  clang-format                        # scripts/format.sh --check
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#PACKAGES[@]} packages present"
  exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
  echo "setup: missing packages: ${missing[*]}" >&2
  echo "setup: run as root:  apt-get update && apt-get install -y ${missing[*]}" >&2
  exit 1
fi

echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
