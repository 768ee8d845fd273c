#include "daemon/text/added_vocab.h"

#include <algorithm>

#include "daemon/text/unicode.h"

namespace ferry::text {
namespace {

// The start of the character that ends at `end` (REQUIRES: end > 0, valid UTF-8).
size_t PrevCharStart(std::string_view s, size_t end) {
  size_t i = end - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  return i;
}

bool EndsWithWord(std::string_view s, size_t end) {
  if (end == 0) return false;
  size_t i = PrevCharStart(s, end);
  return IsWordChar(NextCodePoint(s, &i));
}

bool StartsWithWord(std::string_view s, size_t begin) {
  if (begin >= s.size()) return false;
  return IsWordChar(NextCodePoint(s, &begin));
}

// The start of the run of \s characters that ends at `end` (upstream: the start of the
// match of \s*$ in s[..end]).
size_t WhitespaceRunStart(std::string_view s, size_t end) {
  while (end > 0) {
    const size_t start = PrevCharStart(s, end);
    size_t i = start;
    if (!IsWhiteSpace(NextCodePoint(s, &i))) break;
    end = start;
  }
  return end;
}

// The end of the run of \s characters that starts at `begin` (upstream: ^\s* in s[begin..]).
size_t WhitespaceRunEnd(std::string_view s, size_t begin) {
  while (begin < s.size()) {
    size_t i = begin;
    if (!IsWhiteSpace(NextCodePoint(s, &i))) break;
    begin = i;
  }
  return begin;
}

}  // namespace

AddedVocabulary::AddedVocabulary(std::vector<AddedToken> tokens) : tokens_(std::move(tokens)) {
  raw_.nodes.emplace_back();
  normalized_.nodes.emplace_back();
  for (size_t k = 0; k < tokens_.size(); ++k) {
    const AddedToken& t = tokens_[k];
    Insert(t.normalized ? &normalized_ : &raw_, t.form, static_cast<int32_t>(k));
  }
}

void AddedVocabulary::Insert(Trie* trie, std::string_view text, int32_t token) {
  if (text.empty()) return;
  trie->first_byte[static_cast<unsigned char>(text[0])] = true;
  int32_t node = 0;
  for (char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    auto& children = trie->nodes[node].children;
    auto it = std::lower_bound(children.begin(), children.end(), c,
                               [](const std::pair<unsigned char, int32_t>& e, unsigned char v) { return e.first < v; });
    if (it != children.end() && it->first == c) {
      node = it->second;
    } else {
      const auto next = static_cast<int32_t>(trie->nodes.size());
      children.insert(it, {c, next});
      trie->nodes.emplace_back();
      node = next;
    }
  }
  trie->nodes[node].token = token;
}

std::pair<int32_t, size_t> AddedVocabulary::LongestAt(const Trie& trie, std::string_view text, size_t pos) const {
  std::pair<int32_t, size_t> best{-1, 0};
  int32_t node = 0;
  for (size_t i = pos; i < text.size(); ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    const auto& children = trie.nodes[node].children;
    auto it = std::lower_bound(children.begin(), children.end(), c,
                               [](const std::pair<unsigned char, int32_t>& e, unsigned char v) { return e.first < v; });
    if (it == children.end() || it->first != c) break;
    node = it->second;
    if (trie.nodes[node].token >= 0) best = {trie.nodes[node].token, i + 1 - pos};
  }
  return best;
}

void AddedVocabulary::Split(std::string_view text, bool normalized, std::vector<Segment>* out) const {
  const Trie& trie = normalized ? normalized_ : raw_;
  if (text.empty() || trie.empty()) {
    out->push_back({0, text.size(), -1});
    return;
  }
  size_t start_offset = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    if (!trie.first_byte[static_cast<unsigned char>(text[pos])]) {
      ++pos;
      continue;
    }
    const auto [index, length] = LongestAt(trie, text, pos);
    if (index < 0) {
      ++pos;
      continue;
    }
    size_t start = pos;
    size_t stop = pos + length;
    pos = stop;
    const AddedToken& t = tokens_[index];
    if (t.single_word) {
      const bool start_space = start == 0 || !EndsWithWord(text, start);
      const bool stop_space = stop == text.size() || !StartsWithWord(text, stop);
      if (!start_space || !stop_space) continue;
    }
    if (t.lstrip) start = std::max(WhitespaceRunStart(text, start), start_offset);
    if (t.rstrip) stop = WhitespaceRunEnd(text, stop);
    if (start_offset < start) out->push_back({start_offset, start, -1});
    out->push_back({start, stop, t.id});
    start_offset = stop;
  }
  if (start_offset != text.size()) out->push_back({start_offset, text.size(), -1});
}

}  // namespace ferry::text
