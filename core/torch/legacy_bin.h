// Reader for torch pickles (adapter_model.bin as older PEFT versions save it), through
// LibTorch. Built as the plugin libferry_torchio.so, which core/checkpoint.cpp loads with
// dlopen on the first pickle it meets (entry point ferry_torchio_loader), so nothing else
// links LibTorch.
#pragma once

#include <filesystem>
#include <map>
#include <string>

#include "core/status.h"
#include "core/tensor.h"

namespace ferry::torchio {

// Loads a torch.save()d dict of tensors (zip format). Values that are not tensors, or
// tensors of dtypes safetensors cannot express, are errors naming the key. Returned
// tensors wrap the LibTorch storage without a copy.
Result<std::map<std::string, Tensor>> LoadTorchPickle(const std::filesystem::path& path);

}  // namespace ferry::torchio
