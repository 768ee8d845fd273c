// The BPE model of tokenizer.json (internal to ferry_text), as `tokenizers` runs it
// (tokenizers/src/models/bpe/{model,word}.rs):
//
//   1. ignore_merges: a piece that is itself a vocabulary entry is that one token.
//   2. Each character of the piece becomes the token that is that character; a character
//      with no token becomes its UTF-8 bytes as "<0xHH>" tokens when byte_fallback is on and
//      all of them exist (a pending unknown is NOT flushed before them, as upstream), else
//      the unknown token (consecutive unknowns fused into one with fuse_unk), else nothing.
//   3. Merges: repeatedly the adjacent pair with the lowest merge rank, leftmost first among
//      equal ranks, through a heap of (rank, position): O(n log n) in the piece length. A
//      merge listed twice takes its later rank (the upstream hash map keeps the last).
//
// Thread-safe: Tokenize is const; its cache of recent pieces is sharded under mutexes.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/status.h"

namespace ferry::text {

// Hash for heterogeneous std::string / std::string_view lookups.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using TokenIndex = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

struct BpeOptions {
  std::optional<int32_t> unk_id;  // Default: none (unknown characters are dropped).
  bool fuse_unk = false;          // Default: false.
  bool byte_fallback = false;     // Default: false.
  bool ignore_merges = false;     // Default: false.
};

class BpeModel {
 public:
  // `tokens[id]` is the token of id `id` (ids are dense); `merges` in rank order. kCorruption
  // naming `what` for a token listed twice, and with the merge index when a merge names a
  // missing token or its concatenation is not a token.
  static Result<std::unique_ptr<BpeModel>> Create(std::vector<std::string> tokens,
                                                  const std::vector<std::pair<std::string, std::string>>& merges,
                                                  const BpeOptions& options, std::string_view what);

  // Appends the ids of `piece` (valid UTF-8, not empty) to *out.
  void Tokenize(std::string_view piece, std::vector<int32_t>* out) const;

  int32_t size() const { return static_cast<int32_t>(tokens_.size()); }
  const std::string& token(int32_t id) const { return tokens_[id]; }
  std::optional<int32_t> Find(std::string_view token) const;
  const BpeOptions& options() const { return options_; }

 private:
  struct IndexSlot {
    uint32_t tag = 0;  // high bits of the token's hash
    int32_t id = -1;   // -1: empty
  };
  struct MergeSlot {
    uint64_t key = ~uint64_t{0};  // (left << 32) | right; all ones: empty
    uint32_t rank = 0;
    int32_t result = 0;
  };
  struct CacheShard {
    std::mutex mu;
    std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> map;
  };
  static constexpr size_t kCacheShards = 16;
  static constexpr size_t kCacheEntriesPerShard = 4096;
  static constexpr size_t kMaxCachedPieceBytes = 256;

  BpeModel() = default;
  const MergeSlot* FindMerge(int32_t left, int32_t right) const;
  void InsertMerge(int32_t left, int32_t right, uint32_t rank, int32_t result);
  void MergeWord(std::string_view piece, std::vector<int32_t>* out) const;

  std::vector<std::string> tokens_;
  std::vector<IndexSlot> index_;                    // open addressing, power-of-two size
  std::vector<int32_t> ascii_ids_;                  // id of each one-byte token, -1 when absent
  std::unordered_map<char32_t, int32_t> char_ids_;  // ids of one-character tokens above ASCII
  std::array<int32_t, 256> byte_ids_{};             // "<0xHH>" ids, -1 when absent
  std::vector<MergeSlot> merges_;                   // open addressing, power-of-two size
  BpeOptions options_;
  mutable std::array<CacheShard, kCacheShards> cache_;
};

}  // namespace ferry::text
