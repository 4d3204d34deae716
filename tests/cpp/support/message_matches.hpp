// Whether an error message matches an ECMAScript regex (std::regex_search). Compiled once
// (message_matches.cpp): std::regex is the costliest header the suite used, 4-6 s of compile time per
// file in Release and 16 s under ASan, in each of the five files that checked messages with it.
#pragma once

namespace mha_test {

bool message_matches(const char* message, const char* pattern);

}  // namespace mha_test
