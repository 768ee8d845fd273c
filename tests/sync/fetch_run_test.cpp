// Session::FetchRun (sync/receiver_internal.h) against a fake publisher: one credit window
// over several items, so the requests for the next tensors go out before the first chunk is
// answered; chunks handed to the sink in order at their offsets, `done` once per item, in
// order; items with nothing left to fetch and items resumed part way.
#include <gtest/gtest.h>

#include <cstddef>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>

#include "sync/protocol.h"
#include "sync/receiver_internal.h"

namespace ferry::sync::receiver_internal {
namespace {

// The byte at `offset` of item `index`.
std::byte Pattern(uint32_t index, uint64_t offset) { return static_cast<std::byte>(index * 31 + offset * 7); }

struct Request {
  uint32_t index;
  uint64_t offset;
  uint32_t length;
};

TEST(FetchRunTest, AsksAcrossItemsWithinOneCreditWindowAndReportsEachItemInOrder) {
  zmq::context_t ctx;
  zmq::socket_t router(ctx, zmq::socket_type::router), dealer(ctx, zmq::socket_type::dealer),
      pub(ctx, zmq::socket_type::pub), sub(ctx, zmq::socket_type::sub);
  router.set(zmq::sockopt::rcvtimeo, 3000);  // a receiver that stops asking ends the fake, not the test
  router.bind("inproc://fetch-run");
  dealer.connect("inproc://fetch-run");
  pub.bind("inproc://fetch-run-updates");
  sub.connect("inproc://fetch-run-updates");

  ReceiverOptions o;
  o.id = "fetch-run";
  o.endpoints = {"inproc://fetch-run", "inproc://fetch-run-updates"};
  o.chunk_bytes = 64;
  o.credit = 4;
  o.timeout_ms = 5000;
  Manifest man;
  man.version.lo = 42;
  man.epoch = 7;
  man.sequence = 3;
  // Item 0 and 1: two chunks each; item 2: nothing left (resumed whole); item 3: resumed at
  // 50 of 100; item 4: empty.
  const std::vector<Session::RunItem> items = {{ItemKind::kTensor, 0, 0, 100},
                                               {ItemKind::kTensor, 1, 0, 128},
                                               {ItemKind::kTensor, 2, 100, 100},
                                               {ItemKind::kTensor, 5, 50, 100},
                                               {ItemKind::kTensor, 6, 0, 0}};

  // The fake publisher answers nothing until it holds `credit` requests, then each in order
  // as it comes: 2 + 2 + 0 + 1 + 0 chunks in all.
  constexpr size_t kChunks = 5;
  std::vector<Request> requests;
  std::thread publisher([&] {
    std::vector<std::pair<zmq::message_t, Request>> pending;
    size_t answered = 0;
    while (answered < kChunks) {
      zmq::message_t id, header;
      if (!router.recv(id) || !router.recv(header)) return;
      auto m = Decode(Bytes(header), nullptr);
      ASSERT_TRUE(m.ok()) << m.status().ToString();
      ASSERT_EQ(m->type, MsgType::kFetch);
      requests.push_back({m->index, m->offset, m->length});
      pending.emplace_back(std::move(id), requests.back());
      if (requests.size() < o.credit) continue;
      for (auto& [rid, r] : pending) {
        Message c;
        c.type = MsgType::kChunk;
        c.version = man.version;
        c.epoch = man.epoch;
        c.sequence = man.sequence;
        c.kind = ItemKind::kTensor;
        c.index = r.index;
        c.offset = r.offset;
        std::vector<std::byte> bytes(r.length);
        for (uint32_t k = 0; k < r.length; ++k) bytes[k] = Pattern(r.index, r.offset + k);
        router.send(rid, zmq::send_flags::sndmore);
        router.send(zmq::buffer(EncodeHeader(c)), zmq::send_flags::sndmore);
        router.send(zmq::buffer(bytes.data(), bytes.size()), zmq::send_flags::none);
        ++answered;
      }
      pending.clear();
    }
  });

  Link link;
  link.last_heard = Clock::now();
  Session session(o, dealer, sub, &link);
  std::vector<std::vector<std::byte>> got(items.size());
  for (size_t k = 0; k < items.size(); ++k) got[k].resize(items[k].size);
  std::vector<size_t> done;
  // Every other chunk is moved away by the sink and copied out after the run: the session
  // must not use a chunk once the sink has it.
  struct Kept {
    size_t k;
    uint64_t offset;
    zmq::message_t chunk;
  };
  std::vector<Kept> kept;
  auto copy = [&](size_t k, const zmq::message_t& chunk, uint64_t offset) {
    EXPECT_LE(offset + chunk.size(), items[k].size);
    const auto bytes = Bytes(chunk);
    std::copy(bytes.begin(), bytes.end(), got[k].begin() + static_cast<std::ptrdiff_t>(offset));
  };
  size_t chunks = 0;
  auto run = session.FetchRun(
      man, items,
      [&](size_t k, zmq::message_t& chunk, uint64_t offset) {
        if (chunks++ % 2 == 0) {
          kept.push_back({k, offset, std::move(chunk)});
        } else {
          copy(k, chunk, offset);
        }
        return Status::OK();
      },
      [&](size_t k) {
        done.push_back(k);
        return Status::OK();
      });
  publisher.join();
  ASSERT_TRUE(run.ok()) << run.status().ToString();
  EXPECT_EQ(*run, Outcome::kDone);
  EXPECT_EQ(chunks, kChunks);
  for (const Kept& c : kept) copy(c.k, c.chunk, c.offset);

  // The first four requests, sent before any answer, span items 0 and 1.
  ASSERT_EQ(requests.size(), kChunks);
  const std::vector<std::pair<uint32_t, uint64_t>> expected = {{0, 0}, {0, 64}, {1, 0}, {1, 64}, {5, 50}};
  for (size_t r = 0; r < expected.size(); ++r) {
    EXPECT_EQ(requests[r].index, expected[r].first) << "request " << r;
    EXPECT_EQ(requests[r].offset, expected[r].second) << "request " << r;
  }
  EXPECT_EQ(requests[1].length, 36u) << "the tail of item 0";
  EXPECT_EQ(requests[4].length, 50u) << "item 3 from its resume offset";
  EXPECT_EQ(done, (std::vector<size_t>{0, 1, 2, 3, 4}));
  for (size_t k : {0u, 1u}) {
    for (uint64_t b = 0; b < items[k].size; ++b) ASSERT_EQ(got[k][b], Pattern(items[k].index, b)) << k << " " << b;
  }
  for (uint64_t b = 50; b < 100; ++b) ASSERT_EQ(got[3][b], Pattern(5, b)) << b;
  EXPECT_EQ(session.bytes_received(), 100u + 128u + 50u);
}

}  // namespace
}  // namespace ferry::sync::receiver_internal
