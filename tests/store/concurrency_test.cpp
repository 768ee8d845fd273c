// One Store shared by several threads (store.h, "Thread safety"): concurrent imports into
// one run and into several runs, reads and verification while imports run, events appended
// from several threads, garbage collection against imports, a read-only store refreshed
// while it is read, and a produced checkpoint read one tensor at a time. Also built and run
// under ThreadSanitizer (scripts/test.sh).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <latch>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "core/checkpoint.h"
#include "store/store.h"
#include "tests/store/test_util.h"

namespace ferry::store {
namespace {

using testing::Patterned;
using testing::TempDir;

constexpr size_t kTensorsPerVersion = 5;

// Version `seed`: one tensor every version shares, four of its own.
std::map<std::string, Tensor> VersionTensors(uint32_t seed) {
  std::map<std::string, Tensor> t;
  t["embed.weight"] = Patterned(DType::kBF16, {64, 64}, 7);
  for (uint32_t i = 0; i < kTensorsPerVersion - 1; ++i) {
    t["layers." + std::to_string(i) + ".weight"] = Patterned(DType::kF32, {16, 64}, seed * 16 + i + 100);
  }
  return t;
}

Checkpoint VersionCheckpoint(uint32_t seed) {
  return Checkpoint::FromTensors("version-" + std::to_string(seed), VersionTensors(seed));
}

// Runs `fn(k)` on `n` threads released together.
void RunThreads(int n, const std::function<void(int)>& fn) {
  std::latch start(n);
  std::vector<std::thread> threads;
  for (int k = 0; k < n; ++k) {
    threads.emplace_back([&, k] {
      start.arrive_and_wait();
      fn(k);
    });
  }
  for (auto& t : threads) t.join();
}

// Run with every object a file (parameter 0) and with the default small_object_bytes, under
// which every tensor here is a small object kept in its "objects" row.
class StoreConcurrencyTest : public ::testing::TestWithParam<uint64_t> {
 protected:
  void SetUp() override {
    StoreOptions so;
    so.create_if_missing = true;
    so.small_object_bytes = GetParam();
    auto s = Store::Open(tmp_ / "db", so);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    store_ = std::move(*s);
  }

  // Imports version `seed` into `run`; records the result.
  void Import(uint32_t seed, const std::string& run) {
    ImportOptions o;
    o.run = run;
    o.step = seed;
    auto r = store_->ImportCheckpoint(VersionCheckpoint(seed), {}, o);
    std::lock_guard lock(mu_);
    if (!r.ok()) {
      errors_.push_back(r.status().ToString());
      return;
    }
    results_.push_back({seed, *r});
  }

  // The versions of `run` with sequences 1..N, each parent its predecessor, latest the last.
  void ExpectContiguous(const std::string& run, size_t expected) {
    auto list = store_->ListVersions(run);
    ASSERT_TRUE(list.ok()) << list.status().ToString();
    ASSERT_EQ(list->size(), expected) << "run " << run;
    for (size_t i = 0; i < list->size(); ++i) {
      const VersionRecord& v = (*list)[i];
      EXPECT_EQ(v.sequence, i + 1) << "run " << run;
      EXPECT_EQ(v.tensors.size(), kTensorsPerVersion) << v.id.Hex();
      if (i == 0) {
        EXPECT_FALSE(v.parent.has_value()) << v.id.Hex();
      } else {
        EXPECT_EQ(v.parent, (*list)[i - 1].id) << "run " << run << " sequence " << v.sequence;
      }
    }
    auto latest = store_->Latest(run);
    ASSERT_TRUE(latest.ok()) << latest.status().ToString();
    ASSERT_TRUE(latest->has_value()) << "run " << run;
    EXPECT_EQ(**latest, list->back().id) << "run " << run;
  }

  // Bytes of the distinct tensor objects of every stored version.
  uint64_t DistinctObjectBytes() {
    auto all = store_->ListVersions(std::nullopt);
    EXPECT_TRUE(all.ok()) << all.status().ToString();
    std::map<Digest, uint64_t> objects;
    for (const auto& v : *all) {
      for (const auto& row : v.tensors) objects[row.digest] = row.nbytes;
    }
    uint64_t sum = 0;
    for (const auto& [d, n] : objects) sum += n;
    return sum;
  }

  void ExpectAllVerify() {
    auto reports = store_->Verify(std::nullopt);
    ASSERT_TRUE(reports.ok()) << reports.status().ToString();
    for (const auto& r : *reports) {
      EXPECT_TRUE(r.ok()) << r.version.Hex() << ": " << r.missing.size() << " missing, " << r.corrupted.size()
                          << " corrupted";
    }
  }

  struct Imported {
    uint32_t seed;
    ImportResult result;
  };

  TempDir tmp_;
  std::unique_ptr<Store> store_;
  std::mutex mu_;
  std::vector<Imported> results_;
  std::vector<std::string> errors_;
};

// Several threads import their own versions and two versions every thread imports, all
// into one run: each distinct version is committed exactly once, sequences are 1..N without
// a gap or a duplicate, and every object is written, and counted, once in all.
TEST_P(StoreConcurrencyTest, ImportsIntoOneRunNumberEachVersionOnce) {
  constexpr int kThreads = 4, kOwn = 5;
  const std::vector<uint32_t> common = {900, 901};
  RunThreads(kThreads, [&](int k) {
    for (int i = 0; i < kOwn; ++i) {
      Import(static_cast<uint32_t>(k * 10 + i), "r");
      if (i < static_cast<int>(common.size())) Import(common[static_cast<size_t>(i)], "r");
    }
  });
  ASSERT_TRUE(errors_.empty()) << errors_.front();
  ASSERT_EQ(results_.size(), static_cast<size_t>(kThreads * (kOwn + 2)));

  const size_t distinct = kThreads * kOwn + common.size();
  ExpectContiguous("r", distinct);
  // The common versions: committed by one import, returned as already present (with the
  // same record) by the others.
  for (uint32_t seed : common) {
    int committed = 0;
    std::set<uint64_t> sequences;
    for (const auto& r : results_) {
      if (r.seed != seed) continue;
      committed += !r.result.already_present;
      sequences.insert(r.result.record.sequence);
    }
    EXPECT_EQ(committed, 1) << "version " << seed;
    EXPECT_EQ(sequences.size(), 1u) << "version " << seed;
  }
  uint64_t written = 0;
  for (const auto& r : results_) written += r.result.bytes_written;
  EXPECT_EQ(written, DistinctObjectBytes());
  ExpectAllVerify();
}

// Two imports of different versions that share a tensor, each past the point where it found
// the shared object absent before either commits: the object is stored once, and only the
// import that committed first counts it as written.
TEST_P(StoreConcurrencyTest, ObjectBothImportsFoundAbsentIsCountedOnce) {
  const Tensor shared = Patterned(DType::kBF16, {32, 32}, 5);
  std::latch both_looked(2);
  auto version = [&](uint32_t seed) {
    const Tensor own = Patterned(DType::kF32, {8, 8}, seed);
    std::vector<TensorInfo> infos = {TensorInfo{"a.shared", shared.dtype(), shared.shape(), 0, 0},
                                     TensorInfo{"b.own", own.dtype(), own.shape(), 0, 0}};
    // Tensors are made in name order: when "b.own" is asked for, "a.shared" was stored or
    // found stored.
    return Checkpoint::FromProducer("v" + std::to_string(seed), infos,
                                    [&, own](const std::string& name) -> Result<Tensor> {
                                      if (name == "a.shared") return shared;
                                      both_looked.arrive_and_wait();
                                      return own;
                                    });
  };
  std::vector<ImportResult> results(2);
  std::vector<Status> errors(2);
  RunThreads(2, [&](int k) {
    auto r = store_->ImportCheckpoint(version(static_cast<uint32_t>(k + 1)), {}, ImportOptions{});
    if (r.ok()) {
      results[static_cast<size_t>(k)] = *r;
    } else {
      errors[static_cast<size_t>(k)] = r.status();
    }
  });
  ASSERT_TRUE(errors[0].ok()) << errors[0].ToString();
  ASSERT_TRUE(errors[1].ok()) << errors[1].ToString();
  EXPECT_EQ(results[0].objects_written + results[1].objects_written, 3);
  EXPECT_EQ(results[0].bytes_written + results[1].bytes_written, DistinctObjectBytes());
  EXPECT_EQ(DistinctObjectBytes(), shared.nbytes() + 2 * 8 * 8 * sizeof(float));
  ExpectAllVerify();
}

// Threads import into runs of their own, and all of them one identical version: each run is
// numbered from 1 without gaps; the shared version is recorded once, in one of the runs.
TEST_P(StoreConcurrencyTest, ImportsIntoSeparateRunsAreNumberedPerRun) {
  constexpr int kThreads = 4, kOwn = 4;
  RunThreads(kThreads, [&](int k) {
    const std::string run = "run-" + std::to_string(k);
    for (int i = 0; i < kOwn; ++i) Import(static_cast<uint32_t>(k * 10 + i), run);
    Import(500, run);
  });
  ASSERT_TRUE(errors_.empty()) << errors_.front();
  std::string shared_run;
  int committed = 0;
  for (const auto& r : results_) {
    if (r.seed != 500) continue;
    if (!r.result.already_present) {
      ++committed;
      shared_run = r.result.record.run;
    }
  }
  ASSERT_EQ(committed, 1);
  for (int k = 0; k < kThreads; ++k) {
    const std::string run = "run-" + std::to_string(k);
    ExpectContiguous(run, kOwn + (run == shared_run ? 1 : 0));
  }
  auto runs = store_->ListRuns();
  ASSERT_TRUE(runs.ok()) << runs.status().ToString();
  EXPECT_EQ(runs->size(), static_cast<size_t>(kThreads));
  ExpectAllVerify();
}

// Publisher-style reads in a loop while versions are imported: every version a reader sees
// is whole, its tensors read back and verify, and the run's sequences seen are contiguous.
TEST_P(StoreConcurrencyTest, ReadsDuringImportsSeeWholeVersions) {
  constexpr int kImporters = 2, kReaders = 2, kPerImporter = 6;
  std::atomic<int> importing{kImporters};
  std::atomic<int64_t> reads{0};
  std::vector<std::string> problems;
  std::mutex problems_mu;
  auto problem = [&](const std::string& p) {
    std::lock_guard lock(problems_mu);
    problems.push_back(p);
  };
  RunThreads(kImporters + kReaders, [&](int k) {
    if (k < kImporters) {
      for (int i = 0; i < kPerImporter; ++i) Import(static_cast<uint32_t>(k * 10 + i), "r");
      --importing;
      return;
    }
    do {
      auto list = store_->ListVersions(std::string("r"));
      if (!list.ok()) return problem("ListVersions: " + list.status().ToString());
      for (size_t i = 0; i < list->size(); ++i) {
        const VersionRecord& v = (*list)[i];
        if (v.sequence != i + 1) problem("sequence " + std::to_string(v.sequence) + " at " + std::to_string(i));
        if (v.tensors.size() != kTensorsPerVersion) problem(v.id.Hex() + " has " + std::to_string(v.tensors.size()));
      }
      auto latest = store_->Latest("r");
      if (!latest.ok()) return problem("Latest: " + latest.status().ToString());
      if (!latest->has_value()) continue;
      auto v = store_->GetVersion(latest->value().Hex().substr(0, 12));
      if (!v.ok()) return problem("GetVersion: " + v.status().ToString());
      for (const TensorRow& row : v->tensors) {
        auto t = store_->ReadTensor(row, /*verify=*/true);
        if (!t.ok()) problem("ReadTensor: " + t.status().ToString());
      }
      auto report = store_->Verify(v->id);
      if (!report.ok() || !report->at(0).ok()) problem("Verify " + v->id.Hex());
      ++reads;
    } while (importing.load() > 0);
  });
  ASSERT_TRUE(errors_.empty()) << errors_.front();
  EXPECT_TRUE(problems.empty()) << problems.size() << " problems, first: " << problems.front();
  EXPECT_GT(reads.load(), 0);
  ExpectContiguous("r", kImporters * kPerImporter);
}

// Events appended from several threads, many with the same timestamp: all recorded.
TEST_P(StoreConcurrencyTest, EventsFromSeveralThreadsAreAllRecorded) {
  constexpr int kThreads = 4, kPerThread = 40;
  const Digest version{1, 2};
  std::atomic<int> failures{0};
  RunThreads(kThreads, [&](int k) {
    for (int i = 0; i < kPerThread; ++i) {
      Event e;
      e.type = Event::Type::kAcknowledged;
      e.time_ns = i % 2 == 0 ? 1'700'000'000'000'000'000 : 0;  // equal times, or now
      e.receiver = "r" + std::to_string(k);
      e.version = version;
      e.detail = std::to_string(k) + "/" + std::to_string(i);
      if (!store_->AddEvent(e).ok()) ++failures;
    }
  });
  EXPECT_EQ(failures.load(), 0);
  auto events = store_->ListEvents(version);
  ASSERT_TRUE(events.ok()) << events.status().ToString();
  std::set<std::string> details;
  for (const Event& e : *events) details.insert(e.detail);
  EXPECT_EQ(events->size(), static_cast<size_t>(kThreads * kPerThread));
  EXPECT_EQ(details.size(), static_cast<size_t>(kThreads * kPerThread));
  EXPECT_TRUE(details.count("3/39"));
}

// Garbage collection running again and again while versions are imported never removes an
// object a committed version uses: every version left verifies.
TEST_P(StoreConcurrencyTest, GarbageCollectionDuringImportsKeepsWhatCommits) {
  constexpr int kVersions = 10;
  std::atomic<bool> importing{true};
  std::atomic<int> gc_errors{0};
  RunThreads(2, [&](int k) {
    if (k == 0) {
      for (int i = 0; i < kVersions; ++i) Import(static_cast<uint32_t>(i), "r");
      importing = false;
      return;
    }
    while (importing.load()) {
      if (!store_->GarbageCollect(2).ok()) ++gc_errors;
    }
  });
  ASSERT_TRUE(errors_.empty()) << errors_.front();
  EXPECT_EQ(gc_errors.load(), 0);
  ExpectAllVerify();
  auto latest = store_->Latest("r");
  ASSERT_TRUE(latest.ok() && latest->has_value());
  auto v = store_->GetVersion(latest->value().Hex());
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_EQ(v->step, kVersions - 1);
}

// A read-only store refreshed again and again while other threads read it and a writer in
// this process commits: every read sees whole versions in order.
TEST_P(StoreConcurrencyTest, ReadOnlyStoreRefreshesWhileItIsRead) {
  StoreOptions ro;
  ro.read_only = true;
  auto reader = Store::Open(tmp_ / "db", ro);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  constexpr int kVersions = 8;
  std::atomic<bool> importing{true};
  std::atomic<int> problems{0};
  RunThreads(3, [&](int k) {
    if (k == 0) {
      for (int i = 0; i < kVersions; ++i) Import(static_cast<uint32_t>(i), "r");
      importing = false;
    } else if (k == 1) {
      while (importing.load()) {
        if (!(*reader)->Refresh().ok()) ++problems;
      }
    } else {
      while (importing.load()) {
        auto list = (*reader)->ListVersions(std::string("r"));
        if (!list.ok()) {
          ++problems;
          continue;
        }
        for (size_t i = 0; i < list->size(); ++i) {
          if ((*list)[i].sequence != i + 1 || (*list)[i].tensors.size() != kTensorsPerVersion) ++problems;
        }
      }
    }
  });
  ASSERT_TRUE(errors_.empty()) << errors_.front();
  EXPECT_EQ(problems.load(), 0);
  ASSERT_TRUE((*reader)->Refresh().ok());
  auto list = (*reader)->ListVersions(std::string("r"));
  ASSERT_TRUE(list.ok()) << list.status().ToString();
  EXPECT_EQ(list->size(), static_cast<size_t>(kVersions));
}

// A produced checkpoint (FromProducer, e.g. a LazySnapshot) is asked for one tensor at a
// time, in name order, once each, while other checkpoints are hashed on every core.
TEST_P(StoreConcurrencyTest, ProducedCheckpointIsMadeOneTensorAtATime) {
  const auto tensors = VersionTensors(3);
  std::vector<TensorInfo> infos;
  for (const auto& [name, t] : tensors) infos.push_back(TensorInfo{name, t.dtype(), t.shape(), 0, 0});
  std::atomic<int> in_flight{0}, most{0};
  std::vector<std::string> order;
  std::mutex order_mu;
  auto ckpt = Checkpoint::FromProducer("produced", infos, [&](const std::string& name) -> Result<Tensor> {
    const int now = ++in_flight;
    for (int m = most.load(); now > m && !most.compare_exchange_weak(m, now);) {
    }
    {
      std::lock_guard lock(order_mu);
      order.push_back(name);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    --in_flight;
    return tensors.at(name);
  });
  auto r = store_->ImportCheckpoint(ckpt, {}, ImportOptions{});
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(most.load(), 1);
  std::vector<std::string> expected;
  for (const auto& [name, t] : tensors) expected.push_back(name);
  EXPECT_EQ(order, expected);
  // The same tensors in memory give the same version.
  auto again = store_->ImportCheckpoint(VersionCheckpoint(3), {}, ImportOptions{});
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_TRUE(again->already_present);
  EXPECT_EQ(again->record.id, r->record.id);
}

INSTANTIATE_TEST_SUITE_P(ObjectForms, StoreConcurrencyTest,
                         ::testing::Values(uint64_t{0}, StoreOptions{}.small_object_bytes),
                         [](const ::testing::TestParamInfo<uint64_t>& param) {
                           return param.param == 0 ? std::string("Files") : std::string("SmallObjects");
                         });

}  // namespace
}  // namespace ferry::store
