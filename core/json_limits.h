// Cheap pre-checks for JSON from hostile files, run before a JSON parser sees the text.
#pragma once

#include <string_view>

namespace ferry {

// True when `text` nests arrays/objects more than `limit` deep (string contents skipped).
// Refuses "[[[[..." bombs before a JSON parser spends memory on every level.
bool JsonNestsDeeperThan(std::string_view text, int limit);

}  // namespace ferry
