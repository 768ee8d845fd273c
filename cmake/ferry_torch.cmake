# LibTorch for the parts that use it (core/torch's plugin, daemon/). Included by the top-level
# CMakeLists.txt when FERRY_WITH_TORCH is on; sets FERRY_HAVE_TORCH (ON when found) and, through
# find_package(Torch), TORCH_LIBRARIES.
#
# Two LibTorch builds are in use: Debian's libtorch-dev (1.13, CPU; CMake files in
# /usr/lib/<arch>/cmake, headers in /usr/include) and the CUDA LibTorch inside a PyPI `torch`
# package (its CMake files under torch.utils.cmake_prefix_path). scripts/build-pytorch.sh builds
# against the second one.
#
# One LibTorch per build. The wheel's TorchConfig.cmake looks for Caffe2Config.cmake with
# find_package(Caffe2 PATHS <its own folder>), and find_package searches the system prefixes before
# PATHS: on a machine that also has libtorch-dev, -DTorch_DIR=<wheel> alone takes Debian's Caffe2
# (libraries and targets of 1.13 under the wheel's headers). Such a mix is refused below;
# -DCMAKE_PREFIX_PATH=<cmake_prefix_path> makes both come from the wheel.
#
# libstdc++ first. The PyPI wheels are built on manylinux_2_28 (AlmaLinux 8: system GCC 8, compiler
# GCC 13 from gcc-toolset), whose libstdc++.so is the system one plus libstdc++_nonshared.a: what
# GCC 8's libstdc++.so lacks is linked into each library statically. libtorch_cpu.so thereby defines
# and exports, unversioned, 140 std::filesystem symbols that the system libstdc++.so.6 also defines
# (std::filesystem::remove_all among them), and libc10.so and libtorch.so about 95 others. The
# dynamic loader binds a symbol to the first object in the program's search order (the executable,
# then its DT_NEEDED entries in order) that defines it, and an unversioned definition satisfies a
# versioned reference (ferryd's remove_all@GLIBCXX_3.4.26). g++ appends -lstdc++ after the
# program's own libraries, so libstdc++.so.6 came after libtorch_cpu.so and ferryd's own
# std::filesystem calls ran libtorch_cpu's copy, which crashed in remove_all (a call to address 0).
# Every program linked here therefore names libstdc++ before anything else, --no-as-needed (GCC
# passes --as-needed by default on Debian and Ubuntu, which drops a library named before the
# objects that need it): libstdc++.so.6 is DT_NEEDED entry 1, and every libstdc++ symbol, the
# executable's and LibTorch's own references alike, binds to the system libstdc++ (as
# LD_PRELOAD of it did). With Debian's LibTorch, which exports no libstdc++ symbols, nothing
# changes but the order; tests/daemon/libstdcxx_first_test.sh checks both builds.

# A CUDA LibTorch's Caffe2Config.cmake (public/cuda.cmake) compiles Ferry's CUDA kernels for
# TORCH_CUDA_ARCH_LIST and turns CMAKE_CUDA_ARCHITECTURES off ("pytorch is not compatible with
# CMAKE_CUDA_ARCHITECTURES"); without that list it compiles and runs a program that asks the GPUs,
# which needs a GPU and, with nvcc, CMake 3.26 (that program's C++20). The list is therefore
# taken from CMAKE_CUDA_ARCHITECTURES (80;90 when unset, the default of the top-level
# CMakeLists.txt), unless TORCH_CUDA_ARCH_LIST is given (as a variable or in the environment).
if(NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  if(DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(ferry_cuda_architectures ${CMAKE_CUDA_ARCHITECTURES})
  else()
    set(ferry_cuda_architectures 80 90)
  endif()
  foreach(arch IN LISTS ferry_cuda_architectures)
    if(arch MATCHES "^([0-9]+)([0-9])([af]?)(-real|-virtual)?$")
      list(APPEND TORCH_CUDA_ARCH_LIST "${CMAKE_MATCH_1}.${CMAKE_MATCH_2}${CMAKE_MATCH_3}")
    endif()
  endforeach()
endif()

find_package(Torch QUIET)
if(NOT Torch_FOUND)
  message(STATUS "LibTorch not found: the legacy adapter_model.bin reader is not built")
  return()
endif()

get_filename_component(ferry_torch_cmake_root "${Torch_DIR}/.." REALPATH)
if(DEFINED Caffe2_DIR)
  get_filename_component(ferry_caffe2_cmake_root "${Caffe2_DIR}/.." REALPATH)
  if(NOT ferry_caffe2_cmake_root STREQUAL ferry_torch_cmake_root)
    message(FATAL_ERROR "Two LibTorch installations in one build: Torch from ${Torch_DIR} but Caffe2 "
      "from ${Caffe2_DIR}. Configure a fresh build directory with -DCMAKE_PREFIX_PATH=${ferry_torch_cmake_root} "
      "(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)'), as scripts/build-pytorch.sh does.")
  endif()
endif()

set(FERRY_HAVE_TORCH ON)
message(STATUS "LibTorch ${Torch_VERSION} from ${ferry_torch_cmake_root}")
# Before any target is defined, so that it reaches every program and plugin of the build.
add_link_options("LINKER:--push-state,--no-as-needed,-lstdc++,--pop-state")
