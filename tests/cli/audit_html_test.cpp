// `ferry audit --html`: the report rendered as one self-contained page (cli/audit_html.h).
#include "cli/audit_html.h"

#include <gtest/gtest.h>

#include <string>

namespace ferry::cli {
namespace {

using store::AnomalyKind;
using store::AuditReport;
using store::Digest;
using store::Event;
using store::TimelineEntry;
using store::VersionKind;

AuditReport Report() {
  AuditReport r;
  TimelineEntry base;
  base.version.id = Digest{1, 2};
  base.version.run = "r<&>";
  base.version.sequence = 1;
  base.version.kind = VersionKind::kBase;
  base.version.time_ns = 1'700'000'000'000'000'000;
  TimelineEntry adapter = base;
  adapter.version.id = Digest{3, 4};
  adapter.version.sequence = 2;
  adapter.version.kind = VersionKind::kAdapter;
  adapter.version.step = 4;
  adapter.version.time_ns += 5'000'000'000;
  adapter.version.metrics = {{"reward_mean", 0.25}};
  adapter.activated_by = {"gen-1"};
  adapter.served_by = {"vllm http://h:8000/<x> as ferry-1"};
  r.timeline = {base, adapter};
  store::ReceiverEvent e;
  e.receiver = "gen-1";
  e.type = Event::Type::kActivated;
  e.time_ns = adapter.version.time_ns + 1'000'000'000;
  e.version = adapter.version.id;
  e.computed = Digest{9, 9};
  e.known_version = true;
  e.run = "r<&>";
  e.sequence = 2;
  r.receivers = {e};
  r.anomalies = {
      {AnomalyKind::kDigestMismatch, adapter.version.id, "", "receiver gen-1 computed <other>", std::nullopt}};
  r.metric_names = {"reward_mean"};
  return r;
}

TEST(AuditHtml, OneSelfContainedPageWithTimelinePlotsAndEscapedText) {
  const std::string html = AuditToHtml(Report(), "audit <test>");
  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0u);
  EXPECT_NE(html.find("<title>audit &lt;test&gt;</title>"), std::string::npos);
  EXPECT_NE(html.find("<svg class=\"timeline\""), std::string::npos);
  EXPECT_NE(html.find("<svg class=\"metric\""), std::string::npos);
  EXPECT_NE(html.find(">reward_mean</text>"), std::string::npos);
  EXPECT_NE(html.find("<b>digest_mismatch</b>: receiver gen-1 computed &lt;other&gt;"), std::string::npos);
  EXPECT_NE(html.find("run r&lt;&amp;&gt;"), std::string::npos);
  EXPECT_EQ(html.find("r<&>"), std::string::npos) << "unescaped run name";
  EXPECT_NE(html.find("<th>served by</th>"), std::string::npos);
  EXPECT_NE(html.find("<td>gen-1</td><td>vllm http://h:8000/&lt;x&gt; as ferry-1</td>"), std::string::npos);
  EXPECT_NE(html.find("MISMATCH (" + store::ShortId(Digest{9, 9}) + ")"), std::string::npos);
  for (const char* external : {"<script", "<link", "src=", "@import", "url("}) {
    EXPECT_EQ(html.find(external), std::string::npos) << external;
  }
}

TEST(AuditHtml, EmptyReportSaysSo) {
  const std::string html = AuditToHtml(AuditReport{}, "empty");
  EXPECT_NE(html.find("<p>No versions.</p>"), std::string::npos);
  EXPECT_NE(html.find("<p>No metrics recorded.</p>"), std::string::npos);
  EXPECT_NE(html.find("<p>No receiver events recorded.</p>"), std::string::npos);
}

}  // namespace
}  // namespace ferry::cli
