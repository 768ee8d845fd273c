// core/text.h: the UTF-8 check, message escaping and the printable-name check every name
// that reaches a JSON document goes through; the quoted and number forms of messages.
#include "core/text.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <string>

namespace ferry {
namespace {

constexpr size_t kNpos = std::string_view::npos;

TEST(Utf8Test, WellFormedTextIsAccepted) {
  EXPECT_EQ(FirstInvalidUtf8(""), kNpos);
  EXPECT_EQ(FirstInvalidUtf8("vocab.json"), kNpos);
  EXPECT_EQ(FirstInvalidUtf8("vocab.\xc3\xa9"), kNpos);            // U+00E9
  EXPECT_EQ(FirstInvalidUtf8("\xe6\x97\xa5\xe6\x9c\xac"), kNpos);  // U+65E5 U+672C
  EXPECT_EQ(FirstInvalidUtf8("\xed\x9f\xbf"), kNpos);              // U+D7FF, below the surrogates
  EXPECT_EQ(FirstInvalidUtf8("\xee\x80\x80"), kNpos);              // U+E000, above them
  EXPECT_EQ(FirstInvalidUtf8("\xf0\x9f\x98\x80"), kNpos);          // U+1F600
  EXPECT_EQ(FirstInvalidUtf8("\xf4\x8f\xbf\xbf"), kNpos);          // U+10FFFF
  EXPECT_EQ(FirstInvalidUtf8(std::string("a\0b", 3)), kNpos);      // NUL is UTF-8 (and a control)
}

TEST(Utf8Test, IllFormedTextIsFoundAtItsFirstBadByte) {
  EXPECT_EQ(FirstInvalidUtf8("vocab.\xff"), 6u);
  EXPECT_EQ(FirstInvalidUtf8("\x80"), 0u);              // lone continuation byte
  EXPECT_EQ(FirstInvalidUtf8("ab\xc0\xaf"), 2u);        // overlong '/'
  EXPECT_EQ(FirstInvalidUtf8("\xc1\xbf"), 0u);          // overlong
  EXPECT_EQ(FirstInvalidUtf8("\xe0\x80\xaf"), 0u);      // overlong 3-byte
  EXPECT_EQ(FirstInvalidUtf8("\xf0\x80\x80\xaf"), 0u);  // overlong 4-byte
  EXPECT_EQ(FirstInvalidUtf8("\xed\xa0\x80"), 0u);      // U+D800 (surrogate)
  EXPECT_EQ(FirstInvalidUtf8("\xed\xbf\xbf"), 0u);      // U+DFFF (surrogate)
  EXPECT_EQ(FirstInvalidUtf8("\xf4\x90\x80\x80"), 0u);  // U+110000
  EXPECT_EQ(FirstInvalidUtf8("\xf5\x80\x80\x80"), 0u);
  EXPECT_EQ(FirstInvalidUtf8("x\xe6\x97"), 1u);   // truncated at the end
  EXPECT_EQ(FirstInvalidUtf8("x\xe6\x97y"), 1u);  // truncated in the middle
  EXPECT_EQ(FirstInvalidUtf8("\xf0\x9f\x98"), 0u);
  EXPECT_EQ(FirstInvalidUtf8("\xc3\xa9\xc3"), 2u);
}

TEST(Utf8Test, EscapeForMessageShowsBadBytesAndControlsAsHex) {
  EXPECT_EQ(EscapeForMessage("vocab.\xff"), "vocab.\\xff");
  EXPECT_EQ(EscapeForMessage("vocab.\x01txt"), "vocab.\\x01txt");
  EXPECT_EQ(EscapeForMessage("a\x7f"
                             "b"),
            "a\\x7fb");
  EXPECT_EQ(EscapeForMessage(std::string("a\0b", 3)), "a\\x00b");
  EXPECT_EQ(EscapeForMessage("back\\slash"), "back\\\\slash");
  EXPECT_EQ(EscapeForMessage("vocab.\xe6\x97\xa5"), "vocab.\xe6\x97\xa5");  // well-formed: as is
  EXPECT_EQ(EscapeForMessage("\xed\xa0\x80"), "\\xed\\xa0\\x80");
  EXPECT_EQ(EscapeForMessage("x\xe6\x97"), "x\\xe6\\x97");
  EXPECT_EQ(FirstInvalidUtf8(EscapeForMessage("\xc0\xaf\xff\xfe")), kNpos);
}

TEST(Utf8Test, CheckPrintableUtf8NamesWhatAndTheEscapedText) {
  EXPECT_TRUE(CheckPrintableUtf8("tensor name", "model.embed_tokens.weight").ok());
  EXPECT_TRUE(CheckPrintableUtf8("tensor name", "emb.\xe6\x97\xa5").ok());
  const Status bad = CheckPrintableUtf8("tensor name", "w.\xff");
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.message(), "tensor name 'w.\\xff' is not valid UTF-8");
  const Status control = CheckPrintableUtf8("run name",
                                            "a\x1f"
                                            "b");
  EXPECT_EQ(control.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(control.message(), "run name 'a\\x1fb' contains a control character");
  EXPECT_EQ(CheckPrintableUtf8("x", std::string("\0", 1)).message(), "x '\\x00' contains a control character");
}

TEST(TextFormTest, QuoteAddsSingleQuotesAndNothingElse) {
  EXPECT_EQ(Quote("q_proj"), "'q_proj'");
  EXPECT_EQ(Quote(""), "''");
  EXPECT_EQ(Quote("it's \\x"), "'it's \\x'");
}

TEST(TextFormTest, FormatNumberIsPrintfG) {
  EXPECT_EQ(FormatNumber(0.25, 4), "0.25");
  EXPECT_EQ(FormatNumber(1.0 / 3.0, 3), "0.333");
  EXPECT_EQ(FormatNumber(1.0 / 3.0, 8), "0.33333333");
  EXPECT_EQ(FormatNumber(123456789.0, 4), "1.235e+08");
  EXPECT_EQ(FormatNumber(1e-6, 6), "1e-06");
  EXPECT_EQ(FormatNumber(-2.0, 6), "-2");
  EXPECT_EQ(FormatNumber(std::numeric_limits<double>::infinity(), 4), "inf");
  EXPECT_EQ(FormatNumber(-std::numeric_limits<double>::infinity(), 4), "-inf");
  EXPECT_EQ(FormatNumber(std::nan(""), 4), "nan");
}

// 6 digits is what `std::ostream << double` writes (the inspect and engine reports used it).
TEST(TextFormTest, FormatNumberWithSixDigitsEqualsOstream) {
  for (double v : {0.0, 1.0, 0.5, 16.0, 2.0 / 3.0, 1.0 / std::sqrt(8.0), 1234567.0, 1e-7, -3.25e12,
                   std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity()}) {
    std::ostringstream s;
    s << v;
    EXPECT_EQ(FormatNumber(v, 6), s.str()) << v;
  }
}

TEST(TextTest, QuoteForMessageEscapesAndCuts) {
  EXPECT_EQ(QuoteForMessage("cosine_hard", 80), "\"cosine_hard\"");
  EXPECT_EQ(QuoteForMessage("a\"b\\c\td", 80), "\"a\\\"b\\\\c\\x09d\"");
  EXPECT_EQ(QuoteForMessage("caf\xc3\xa9 \xff", 80), "\"caf\xc3\xa9 \\xff\"");
  EXPECT_EQ(QuoteForMessage("abcdef", 4), "\"abcd\"... (6 bytes)");
  EXPECT_EQ(QuoteForMessage("", 4), "\"\"");
}

}  // namespace
}  // namespace ferry
