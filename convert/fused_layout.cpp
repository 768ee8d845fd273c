#include "convert/fused_layout.h"

#include <algorithm>
#include <map>
#include <set>

#include "core/text.h"

namespace ferry {
namespace {

struct Group {
  std::vector<std::string> members;
  std::string fused;
};

const std::vector<Group>& Groups() {
  static const std::vector<Group> kGroups = {{{"q_proj", "k_proj", "v_proj"}, "qkv_proj"},
                                             {{"gate_proj", "up_proj"}, "gate_up_proj"}};
  return kGroups;
}

std::string Describe(const TensorSpec& t) {
  return Quote(t.name) + " " + ShapeToString(t.shape) + " " + std::string(DTypeName(t.dtype));
}

}  // namespace

Result<std::vector<LaidOutTensor>> FuseLayout(const std::vector<TensorSpec>& tensors, std::string_view where) {
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < tensors.size(); ++i) index.emplace(tensors[i].name, i);
  // First member's index -> the fused tensor; every member consumed.
  std::map<size_t, LaidOutTensor> fused_at;
  std::set<std::string> consumed;
  for (const TensorSpec& t0 : tensors) {
    for (const Group& g : Groups()) {
      for (const char* param : {".weight", ".bias"}) {
        const std::string first = "." + g.members[0] + param;
        if (!t0.name.ends_with(first)) continue;
        const std::string prefix = t0.name.substr(0, t0.name.size() - first.size() + 1);
        LaidOutTensor out;
        int64_t rows = 0;
        bool complete = true;
        for (const std::string& m : g.members) {
          auto it = index.find(prefix + m + param);
          if (it == index.end()) {
            complete = false;
            break;
          }
          const TensorSpec& t = tensors[it->second];
          if (t.shape.empty() || t.shape.size() != t0.shape.size() ||
              !std::equal(t.shape.begin() + 1, t.shape.end(), t0.shape.begin() + 1) || t.dtype != t0.dtype) {
            return Status::InvalidArgument(std::string(where) + ": cannot fuse " + Describe(t) + " with " +
                                           Describe(t0));
          }
          rows += t.shape[0];
          out.parts.push_back(t.name);
        }
        if (!complete) continue;
        out.spec.name = prefix + g.fused + param;
        if (index.count(out.spec.name)) {
          return Status::InvalidArgument(std::string(where) + ": has both " + Quote(out.spec.name) + " and " +
                                         Quote(t0.name));
        }
        out.spec.dtype = t0.dtype;
        out.spec.shape = t0.shape;
        out.spec.shape[0] = rows;
        consumed.insert(out.parts.begin(), out.parts.end());
        fused_at.emplace(index.at(t0.name), std::move(out));
      }
    }
  }
  std::vector<LaidOutTensor> result;
  result.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (auto f = fused_at.find(i); f != fused_at.end()) {
      result.push_back(std::move(f->second));
    } else if (!consumed.count(tensors[i].name)) {
      result.push_back(LaidOutTensor{tensors[i], {tensors[i].name}});
    }
  }
  return result;
}

}  // namespace ferry
