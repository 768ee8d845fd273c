// config.json's tie_word_embeddings, as every part that merges reads it (core/aux_files.h).
#include "core/aux_files.h"

#include <gtest/gtest.h>

namespace ferry {
namespace {

TEST(TiesWordEmbeddings, ReadsTheBooleanOfConfigJson) {
  EXPECT_TRUE(TiesWordEmbeddings({{"config.json", R"({"tie_word_embeddings": true})"}}));
  EXPECT_FALSE(TiesWordEmbeddings({{"config.json", R"({"tie_word_embeddings": false})"}}));
  // Another file's key does not count; config.json is found among others.
  EXPECT_FALSE(TiesWordEmbeddings({{"generation_config.json", R"({"tie_word_embeddings": true})"}}));
  EXPECT_TRUE(TiesWordEmbeddings(
      {{"config.json", R"({"hidden_size": 8, "tie_word_embeddings": true})"}, {"tokenizer.json", "{}"}}));
}

TEST(TiesWordEmbeddings, IsFalseWhenAbsentOrNotABoolean) {
  EXPECT_FALSE(TiesWordEmbeddings({}));
  EXPECT_FALSE(TiesWordEmbeddings({{"config.json", R"({"hidden_size": 8})"}}));
  EXPECT_FALSE(TiesWordEmbeddings({{"config.json", R"({"tie_word_embeddings": "true"})"}}));
  EXPECT_FALSE(TiesWordEmbeddings({{"config.json", R"({"tie_word_embeddings": 1})"}}));
  EXPECT_FALSE(TiesWordEmbeddings({{"config.json", "[true]"}}));
  EXPECT_FALSE(TiesWordEmbeddings({{"config.json", "{not json"}}));
}

}  // namespace
}  // namespace ferry
