// Added tokens (tokenizer.json "added_tokens"), matched in text as `tokenizers` does
// (tokenizers/src/tokenizer/added_vocabulary.rs). Internal to ferry_text.
//
// Encode first splits the raw text by the tokens with normalized=false, then normalizes
// every remaining piece on its own and splits it by the tokens with normalized=true (matched
// in their normalized form). Each split is a leftmost-longest scan over the token texts
// (an Aho-Corasick automaton upstream, a byte trie here; both yield the same non-overlapping
// matches). A match is then:
//   - dropped when the token is single_word and a \w character touches it on either side
//     (the scan still resumes after the dropped match);
//   - widened left over the \s characters before it (lstrip), never before the end of the
//     previous match, and right over the \s characters after it (rstrip).
// \w and \s are the Rust regex classes (unicode.h). Matches become token pieces; the text
// between them stays text.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace ferry::text {

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = true;
  bool special = false;
  // What is matched, and what decoding sees: the normalizer's output for `content` when
  // normalized is set and the two differ, else `content` (upstream's normalized cache).
  std::string form;
};

class AddedVocabulary {
 public:
  // A piece of text: [begin, end) of the text given to Split, and the added token's id or -1.
  struct Segment {
    size_t begin;
    size_t end;
    int32_t id;
  };

  AddedVocabulary() = default;
  // REQUIRES: contents are distinct and not empty.
  explicit AddedVocabulary(std::vector<AddedToken> tokens);

  const std::vector<AddedToken>& tokens() const { return tokens_; }

  // Splits `text` by the tokens whose `normalized` flag equals `normalized`, appending the
  // segments (empty ones included, as upstream before its filter) to *out.
  void Split(std::string_view text, bool normalized, std::vector<Segment>* out) const;

 private:
  struct Trie {
    struct Node {
      std::vector<std::pair<unsigned char, int32_t>> children;  // sorted by byte
      int32_t token = -1;                                       // index into tokens_
    };
    std::vector<Node> nodes;
    std::array<bool, 256> first_byte{};
    bool empty() const { return nodes.size() <= 1; }
  };
  static void Insert(Trie* trie, std::string_view text, int32_t token);
  // The longest token that starts at `pos`: (index, length), or index -1.
  std::pair<int32_t, size_t> LongestAt(const Trie& trie, std::string_view text, size_t pos) const;

  std::vector<AddedToken> tokens_;
  Trie raw_;
  Trie normalized_;
};

}  // namespace ferry::text
