#include "daemon/text/bpe.h"

#include <algorithm>
#include <cstdio>

#include "daemon/text/unicode.h"

namespace ferry::text {
namespace {

uint64_t MergeKey(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

size_t MixKey(uint64_t key) {
  key ^= key >> 33;
  key *= 0xff51afd7ed558ccdull;
  key ^= key >> 33;
  key *= 0xc4ceb9fe1a85ec53ull;
  key ^= key >> 33;
  return static_cast<size_t>(key);
}

struct Symbol {
  int32_t id;
  int32_t prev;  // index of the previous live symbol, -1 for none
  int32_t next;  // index of the next live symbol, -1 for none
  uint32_t len;  // bytes of the piece it covers; 0 once merged into its left neighbour
};

struct QueuedMerge {
  uint32_t rank;
  int32_t pos;
  int32_t result;
};

// std::push_heap keeps the "largest" first: order so that the lowest (rank, pos) is on top.
struct LaterMerge {
  bool operator()(const QueuedMerge& a, const QueuedMerge& b) const {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  }
};

}  // namespace

Result<std::unique_ptr<BpeModel>> BpeModel::Create(std::vector<std::string> tokens,
                                                   const std::vector<std::pair<std::string, std::string>>& merges,
                                                   const BpeOptions& options, std::string_view what) {
  std::unique_ptr<BpeModel> m(new BpeModel());
  m->tokens_ = std::move(tokens);
  m->options_ = options;
  size_t index_cap = 16;
  while (index_cap < m->tokens_.size() * 2) index_cap <<= 1;
  m->index_.assign(index_cap, IndexSlot{});
  m->ascii_ids_.assign(128, -1);
  m->byte_ids_.fill(-1);
  for (size_t id = 0; id < m->tokens_.size(); ++id) {
    const std::string& t = m->tokens_[id];
    const auto i = static_cast<int32_t>(id);
    {
      const size_t h = std::hash<std::string_view>{}(t);
      const size_t mask = m->index_.size() - 1;
      for (size_t k = h & mask;; k = (k + 1) & mask) {
        IndexSlot& slot = m->index_[k];
        if (slot.id < 0) {
          slot = {static_cast<uint32_t>(h >> 32), i};
          break;
        }
        if (slot.tag == static_cast<uint32_t>(h >> 32) && m->tokens_[slot.id] == t) {
          return Status::Corruption(std::string(what) + ".vocab: \"" + t + "\" is listed twice (ids " +
                                    std::to_string(slot.id) + " and " + std::to_string(i) + ")");
        }
      }
    }
    if (t.size() == 1 && static_cast<unsigned char>(t[0]) < 0x80) {
      m->ascii_ids_[static_cast<unsigned char>(t[0])] = i;
    } else if (!t.empty() && Utf8SequenceLength(static_cast<unsigned char>(t[0])) == t.size()) {
      size_t pos = 0;
      m->char_ids_.emplace(NextCodePoint(t, &pos), i);
    }
    if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>') {
      // Only the spelling byte_fallback looks up: "<0x" + two upper-case hex digits + ">".
      unsigned value = 0;
      bool ok = true;
      for (int k = 3; k < 5; ++k) {
        const char c = t[k];
        if (c >= '0' && c <= '9') {
          value = value * 16 + (c - '0');
        } else if (c >= 'A' && c <= 'F') {
          value = value * 16 + (c - 'A' + 10);
        } else {
          ok = false;
        }
      }
      if (ok) m->byte_ids_[value] = i;
    }
  }

  size_t cap = 16;
  while (cap < merges.size() * 2) cap <<= 1;
  m->merges_.assign(cap, MergeSlot{});
  std::string joined;
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [a, b] = merges[rank];
    const auto ia = m->Find(a);
    const auto ib = m->Find(b);
    const auto merge_at = [&] { return std::string(what) + ".merges[" + std::to_string(rank) + "]"; };
    if (!ia) return Status::Corruption(merge_at() + ": \"" + a + "\" is not in the vocabulary");
    if (!ib) return Status::Corruption(merge_at() + ": \"" + b + "\" is not in the vocabulary");
    joined.assign(a).append(b);
    const auto ir = m->Find(joined);
    if (!ir) return Status::Corruption(merge_at() + ": the merged token \"" + joined + "\" is not in the vocabulary");
    m->InsertMerge(*ia, *ib, static_cast<uint32_t>(rank), *ir);
  }
  return m;
}

std::optional<int32_t> BpeModel::Find(std::string_view token) const {
  const size_t h = std::hash<std::string_view>{}(token);
  const auto tag = static_cast<uint32_t>(h >> 32);
  const size_t mask = index_.size() - 1;
  for (size_t k = h & mask;; k = (k + 1) & mask) {
    const IndexSlot& slot = index_[k];
    if (slot.id < 0) return std::nullopt;
    if (slot.tag == tag && tokens_[slot.id] == token) return slot.id;
  }
}

const BpeModel::MergeSlot* BpeModel::FindMerge(int32_t left, int32_t right) const {
  const uint64_t key = MergeKey(left, right);
  const size_t mask = merges_.size() - 1;
  for (size_t i = MixKey(key) & mask;; i = (i + 1) & mask) {
    const MergeSlot& s = merges_[i];
    if (s.key == key) return &s;
    if (s.key == ~uint64_t{0}) return nullptr;
  }
}

void BpeModel::InsertMerge(int32_t left, int32_t right, uint32_t rank, int32_t result) {
  const uint64_t key = MergeKey(left, right);
  const size_t mask = merges_.size() - 1;
  for (size_t i = MixKey(key) & mask;; i = (i + 1) & mask) {
    MergeSlot& s = merges_[i];
    if (s.key == key || s.key == ~uint64_t{0}) {
      s.key = key;
      s.rank = rank;
      s.result = result;
      return;
    }
  }
}

void BpeModel::Tokenize(std::string_view piece, std::vector<int32_t>* out) const {
  if (piece.empty()) return;
  if (options_.ignore_merges) {
    if (const auto id = Find(piece)) {
      out->push_back(*id);
      return;
    }
  }
  if (piece.size() >= kMaxCachedPieceBytes) {
    MergeWord(piece, out);
    return;
  }
  CacheShard& shard = cache_[std::hash<std::string_view>{}(piece) % kCacheShards];
  {
    std::lock_guard<std::mutex> lock(shard.mu);
    const auto it = shard.map.find(piece);
    if (it != shard.map.end()) {
      out->insert(out->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = out->size();
  MergeWord(piece, out);
  std::lock_guard<std::mutex> lock(shard.mu);
  if (shard.map.size() < kCacheEntriesPerShard) {
    shard.map.emplace(std::string(piece),
                      std::vector<int32_t>(out->begin() + static_cast<ptrdiff_t>(first), out->end()));
  }
}

void BpeModel::MergeWord(std::string_view piece, std::vector<int32_t>* out) const {
  std::vector<Symbol> symbols;
  symbols.reserve(piece.size());
  const auto add = [&symbols](int32_t id, uint32_t len) {
    const auto n = static_cast<int32_t>(symbols.size());
    if (n > 0) symbols.back().next = n;
    symbols.push_back({id, n - 1, -1, len});
  };
  int32_t unk_id = -1;  // pending unknown token (-1: none) and the bytes it covers
  uint32_t unk_len = 0;
  const auto flush_unk = [&] {
    if (unk_id >= 0) add(unk_id, unk_len);
    unk_id = -1;
  };
  size_t i = 0;
  while (i < piece.size()) {
    const size_t start = i;
    const char32_t cp = NextCodePoint(piece, &i);
    const auto len = static_cast<uint32_t>(i - start);
    int32_t id = -1;
    if (cp < 0x80) {
      id = ascii_ids_[cp];
    } else {
      const auto it = char_ids_.find(cp);
      if (it != char_ids_.end()) id = it->second;
    }
    if (id >= 0) {
      flush_unk();
      add(id, len);
      continue;
    }
    if (options_.byte_fallback) {
      bool all = true;
      for (size_t k = start; k < i; ++k) all = all && byte_ids_[static_cast<unsigned char>(piece[k])] >= 0;
      if (all) {
        for (size_t k = start; k < i; ++k) add(byte_ids_[static_cast<unsigned char>(piece[k])], 1);
        continue;
      }
    }
    if (options_.unk_id) {
      if (unk_id >= 0 && options_.fuse_unk) {
        unk_len += len;
      } else {
        flush_unk();
        unk_id = *options_.unk_id;
        unk_len = len;
      }
    }
  }
  flush_unk();

  std::vector<QueuedMerge> heap;
  heap.reserve(symbols.size());
  for (size_t k = 0; k + 1 < symbols.size(); ++k) {
    if (const MergeSlot* m = FindMerge(symbols[k].id, symbols[k + 1].id)) {
      heap.push_back({m->rank, static_cast<int32_t>(k), m->result});
    }
  }
  std::make_heap(heap.begin(), heap.end(), LaterMerge{});
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), LaterMerge{});
    const QueuedMerge top = heap.back();
    heap.pop_back();
    Symbol& cur = symbols[top.pos];
    if (cur.len == 0 || cur.next == -1) continue;
    const int32_t next_pos = cur.next;
    const Symbol right = symbols[next_pos];
    const MergeSlot* m = FindMerge(cur.id, right.id);
    if (m == nullptr || m->result != top.result) continue;  // an entry made stale by an earlier merge
    cur.id = top.result;
    cur.len += right.len;
    cur.next = right.next;
    symbols[next_pos].len = 0;
    if (right.next >= 0) symbols[right.next].prev = top.pos;
    if (cur.prev >= 0) {
      if (const MergeSlot* pm = FindMerge(symbols[cur.prev].id, cur.id)) {
        heap.push_back({pm->rank, cur.prev, pm->result});
        std::push_heap(heap.begin(), heap.end(), LaterMerge{});
      }
    }
    if (cur.next >= 0) {
      if (const MergeSlot* nm = FindMerge(cur.id, symbols[cur.next].id)) {
        heap.push_back({nm->rank, top.pos, nm->result});
        std::push_heap(heap.begin(), heap.end(), LaterMerge{});
      }
    }
  }
  for (const Symbol& s : symbols) {
    if (s.len != 0) out->push_back(s.id);
  }
}

}  // namespace ferry::text
