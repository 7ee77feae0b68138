#!/usr/bin/env bash
# llama.cpp's source for the side-by-side benchmark (bench/llamacpp.py), into the git-ignored
# .llama/ that the device tool carries: the llama.cpp vendored in the llama-cpp-python sdist (a
# registry package, so pip fetches it where the hub cannot be reached), stripped of what a
# llama-bench build with the CPU and CUDA backends does not read (test models, docs, web UI, the
# other backends), its tools/ cut down to llama-bench and llama-completion; with the sdist's
# ctypes bindings. ~5 MB as .tar.xz.
# Run here, from the repo root:  bash bench/fetch_llamacpp.sh [VERSION]
set -euo pipefail
VERSION=${1:-0.3.36}
mkdir -p .llama
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tmp"
tar xzf "$tmp"/llama_cpp_python-"$VERSION".tar.gz -C "$tmp"
L="$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp"
rm -rf "$L"/models "$L"/docs "$L"/tools/ui "$L"/benches "$L"/examples "$L"/tests
for b in sycl vulkan opencl cann musa hip metal kompute webgpu zdnn openvino hexagon rpc blas virtgpu zendnn; do
  rm -rf "$L/ggml/src/ggml-$b"
done
printf 'find_package(Threads REQUIRED)\nllama_add_compile_flags()\nadd_subdirectory(llama-bench)\nadd_subdirectory(completion)\n' \
  > "$L/tools/CMakeLists.txt"
echo "llama-cpp-python $VERSION" > "$L/FREETOKEN_SOURCE"
# its ctypes bindings too (bench.llamacpp --check reads logits through them)
mkdir -p "$tmp/stage/llama_cpp_python"
mv "$L" "$tmp/stage/llama.cpp"
cp -r "$tmp/llama_cpp_python-$VERSION/llama_cpp" "$tmp/stage/llama_cpp_python/"
tar cJf .llama/llama.cpp.tar.xz -C "$tmp/stage" llama.cpp llama_cpp_python
ls -la .llama/llama.cpp.tar.xz
