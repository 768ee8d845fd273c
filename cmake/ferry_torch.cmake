# LibTorch for the parts that use it (core/torch's plugin, daemon/). Included by the top-level
# CMakeLists.txt when FERRY_WITH_TORCH is on; sets FERRY_HAVE_TORCH (ON when found) and, through
# find_package(Torch), TORCH_LIBRARIES.
#
# Two LibTorch builds are in use: Debian's libtorch-dev (1.13, CPU; CMake files in
# /usr/lib/<arch>/cmake, libraries in /usr/lib/<arch>, headers in /usr/include) and the CUDA
# LibTorch inside a PyPI `torch` package (<torch>/share/cmake, <torch>/lib, <torch>/include).
# scripts/build-pytorch.sh builds against the second one with -DTorch_DIR=<torch>/share/cmake/Torch.
#
# One LibTorch per build. The package's TorchConfig.cmake looks for its parts with
# find_package(Caffe2 PATHS <beside it>) and find_library(c10 PATHS <torch>/lib), and both search
# the system prefixes before PATHS: on a machine that also has libtorch-dev they took Debian's
# Caffe2 or libc10.so (1.13) under the package's headers. <torch> is therefore searched first here
# (CMAKE_PREFIX_PATH, while LibTorch is found), and a build whose LibTorch libraries or CMake files
# come from two places is refused.
#
# libstdc++ first. The PyPI packages are built on manylinux_2_28 (AlmaLinux 8: GCC 8's
# libstdc++.so.6, compiler GCC 13 from gcc-toolset), whose libstdc++.so links what GCC 8's
# libstdc++.so.6 lacks statically into each library (libstdc++_nonshared.a). libtorch_cpu.so so
# defines and exports, unversioned, 140 std::filesystem symbols the system libstdc++.so.6 defines
# too (std::filesystem::remove_all among them); libc10.so and libtorch.so about 95 others. The
# loader binds a symbol to the first object in the program's search order that defines it (the
# executable, then its DT_NEEDED entries in order), and an unversioned definition satisfies a
# versioned reference (ferryd's remove_all@GLIBCXX_3.4.26). g++ appends -lstdc++ after the
# program's own libraries, so libstdc++.so.6 came after libtorch_cpu.so and ferryd's own
# std::filesystem calls ran libtorch_cpu's copy, which crashed. Every program linked here therefore
# names libstdc++ before anything else, --no-as-needed (GCC passes --as-needed by default on Debian
# and Ubuntu, which drops a library named before the objects that need it): libstdc++.so.6 is
# DT_NEEDED entry 1, and every libstdc++ symbol, the program's and LibTorch's own references alike,
# binds to the system libstdc++, as it did with LD_PRELOAD of it. With Debian's LibTorch, which
# exports no libstdc++ symbols, only the order changes. tests/daemon/libstdcxx_first_test.sh checks
# the order and the loader's bindings.

# A CUDA LibTorch's Caffe2Config.cmake (public/cuda.cmake) compiles Ferry's CUDA kernels for
# TORCH_CUDA_ARCH_LIST and turns CMAKE_CUDA_ARCHITECTURES off ("pytorch is not compatible with
# CMAKE_CUDA_ARCHITECTURES"); without that list it compiles and runs a program that asks the GPUs,
# which needs a GPU and, with nvcc, CMake 3.26 (that program's C++20). The list is therefore taken
# from CMAKE_CUDA_ARCHITECTURES (80;90 when unset, the default of the top-level CMakeLists.txt),
# unless TORCH_CUDA_ARCH_LIST is given (as a variable or in the environment).
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

set(ferry_saved_prefix_path "${CMAKE_PREFIX_PATH}")
if(Torch_DIR MATCHES "/share/cmake/Torch/?$")
  get_filename_component(ferry_torch_prefix "${Torch_DIR}/../../.." ABSOLUTE)
  list(PREPEND CMAKE_PREFIX_PATH "${ferry_torch_prefix}")
endif()
find_package(Torch QUIET)
set(CMAKE_PREFIX_PATH "${ferry_saved_prefix_path}")
if(NOT Torch_FOUND)
  message(STATUS "LibTorch not found: the legacy adapter_model.bin reader is not built")
  return()
endif()

# One LibTorch: its CMake files in one folder, its libraries (the paths TORCH_LIBRARIES names and
# the imported targets' files) in one folder.
get_filename_component(ferry_torch_cmake "${Torch_DIR}/.." REALPATH)
get_filename_component(ferry_caffe2_cmake "${Caffe2_DIR}/.." REALPATH)
set(ferry_torch_files)
foreach(item IN LISTS TORCH_LIBRARIES)
  if(TARGET ${item})
    get_target_property(configs ${item} IMPORTED_CONFIGURATIONS)
    list(TRANSFORM configs PREPEND IMPORTED_LOCATION_)
    foreach(property IN ITEMS IMPORTED_LOCATION LISTS configs)
      get_target_property(location ${item} ${property})
      if(location)
        list(APPEND ferry_torch_files "${location}")
      endif()
    endforeach()
  elseif(IS_ABSOLUTE "${item}")
    list(APPEND ferry_torch_files "${item}")
  endif()
endforeach()
set(ferry_torch_lib_dirs)
foreach(file IN LISTS ferry_torch_files)
  get_filename_component(name "${file}" NAME)
  if(name MATCHES "^lib(torch|c10|caffe2)")
    get_filename_component(dir "${file}" DIRECTORY)
    get_filename_component(dir "${dir}" REALPATH)
    list(APPEND ferry_torch_lib_dirs "${dir}")
  endif()
endforeach()
list(REMOVE_DUPLICATES ferry_torch_lib_dirs)
list(LENGTH ferry_torch_lib_dirs ferry_torch_lib_dir_count)
if(NOT ferry_caffe2_cmake STREQUAL ferry_torch_cmake OR NOT ferry_torch_lib_dir_count EQUAL 1)
  message(FATAL_ERROR "Two LibTorch installations in one build: Torch's CMake files in ${ferry_torch_cmake}, "
    "Caffe2's in ${ferry_caffe2_cmake}, libraries in ${ferry_torch_lib_dirs}. Configure a new build directory "
    "(a cache keeps what an earlier configuration found), with -DTorch_DIR=<torch>/share/cmake/Torch for a PyPI "
    "torch, as scripts/build-pytorch.sh does.")
endif()

# A PyPI LibTorch finds the libraries it needs (NCCL, cuDNN, the CUDA libraries of the nvidia-*
# packages) through its RPATH ($ORIGIN/../../nvidia/...), and the loader looks there first. The
# linker, resolving those libraries' own dependencies, looks in the program's -rpath folders first
# (the CUDA toolkit's lib/, where libcudart.so lies), and took an older libnccl.so.2 there
# (ncclSignal undefined); as -rpath-link folders, LibTorch's RPATH comes first for it too.
set(ferry_torch_rpath_dirs)
file(GLOB ferry_torch_shared_libs "${ferry_torch_lib_dirs}/libtorch*.so" "${ferry_torch_lib_dirs}/libc10*.so")
foreach(lib IN LISTS ferry_torch_shared_libs)
  file(READ_ELF "${lib}" RPATH rpath CAPTURE_ERROR error)
  string(REPLACE "$ORIGIN" "${ferry_torch_lib_dirs}" rpath "${rpath}")
  string(REPLACE ":" ";" rpath "${rpath}")
  foreach(dir IN LISTS rpath)
    if(IS_DIRECTORY "${dir}")
      get_filename_component(dir "${dir}" REALPATH)
      list(APPEND ferry_torch_rpath_dirs "${dir}")
    endif()
  endforeach()
endforeach()
list(REMOVE_DUPLICATES ferry_torch_rpath_dirs)

set(FERRY_HAVE_TORCH ON)
# A CUDA LibTorch (PyPI's) appends libc10_cuda and the CUDA libraries as TORCH_CUDA_LIBRARIES;
# Debian's CPU build sets none. The runtime's CUDA-only parts (cuda_graph.cpp) compile on this.
if(TORCH_CUDA_LIBRARIES)
  set(FERRY_TORCH_CUDA ON)
else()
  set(FERRY_TORCH_CUDA OFF)
endif()
message(STATUS "LibTorch ${Torch_VERSION}: CMake files in ${ferry_torch_cmake}, libraries in ${ferry_torch_lib_dirs}, "
  "CUDA ${FERRY_TORCH_CUDA}")
# Before any target is defined, so that they reach every program and plugin of the build.
add_link_options("LINKER:--push-state,--no-as-needed,-lstdc++,--pop-state")
if(ferry_torch_rpath_dirs)
  list(JOIN ferry_torch_rpath_dirs ":" ferry_torch_rpath_dirs)
  add_link_options("LINKER:-rpath-link,${ferry_torch_rpath_dirs}")
endif()
