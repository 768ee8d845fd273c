// WriteBehind (sync/receiver_internal.h): the receiver's writer thread. Chunks are written in
// the order queued (a refetched range overwrites the first copy), small and large alike, with
// Submit blocking while `depth` chunks wait; a write error names the file, stops the writes
// after it, and is returned by Drain and by every later Submit.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstddef>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>
#include <zmq.hpp>

#include "sync/receiver_internal.h"
#include "tests/temp_dir.h"

namespace ferry::sync::receiver_internal {
namespace {

zmq::message_t Chunk(const std::string& bytes) { return zmq::message_t(bytes.data(), bytes.size()); }

std::string ReadAll(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

TEST(WriteBehindTest, WritesEveryChunkInTheOrderQueued) {
  ferry::testing::ScopedTempDir tmp("ferry_write_behind_");
  const auto path = tmp.path() / "model.safetensors";
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  // 300 chunks of 1..4 KiB (small ones live inside the ZeroMQ message itself), each written
  // twice at its place, first with wrong bytes: only the second copy may remain.
  std::string expected;
  {
    WriteBehind writer(fd, path, /*depth=*/2);
    for (int i = 0; i < 300; ++i) {
      const size_t size = (i % 3 == 0) ? 7 : 1024 + 13 * static_cast<size_t>(i);
      const std::string right(size, static_cast<char>('a' + i % 26));
      const uint64_t at = expected.size();
      ASSERT_TRUE(writer.Submit(Chunk(std::string(size, '#')), at).ok());
      ASSERT_TRUE(writer.Submit(Chunk(right), at).ok());
      expected += right;
    }
    const Status drained = writer.Drain();
    ASSERT_TRUE(drained.ok()) << drained.ToString();
    EXPECT_EQ(ReadAll(path), expected) << "read before the writer is destroyed";
  }
  ::close(fd);
  EXPECT_EQ(ReadAll(path), expected);
}

TEST(WriteBehindTest, AWriteErrorNamesTheFileAndStopsTheWritesAfterIt) {
  ferry::testing::ScopedTempDir tmp("ferry_write_behind_");
  const auto path = tmp.path() / "model.safetensors";
  { std::ofstream(path) << "x"; }
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);  // every write fails (EBADF)
  ASSERT_GE(fd, 0);
  {
    WriteBehind writer(fd, path, /*depth=*/1);
    const Status first = writer.Submit(Chunk("abc"), 4096);
    const Status drained = writer.Drain();
    EXPECT_TRUE(first.ok()) << "queued before the write failed: " << first.ToString();
    EXPECT_EQ(drained.code(), StatusCode::kIOError) << drained.ToString();
    EXPECT_NE(drained.message().find(path.string()), std::string::npos) << drained.message();
    EXPECT_NE(drained.message().find("offset 4096"), std::string::npos) << drained.message();
    const Status later = writer.Submit(Chunk("def"), 0);
    EXPECT_EQ(later.code(), StatusCode::kIOError);
    EXPECT_EQ(later.message(), drained.message());
    EXPECT_EQ(writer.Drain().message(), drained.message());
  }
  ::close(fd);
  EXPECT_EQ(ReadAll(path), "x");
}

}  // namespace
}  // namespace ferry::sync::receiver_internal
