// The bad-input tests (attention/, layer/ and tensor/bad_input_test.cpp). Each table case must throw
// mha::Error (a std::invalid_argument) whose message names the offending argument, as
// include/mha/error.hpp promises; one named test per case. For inputs the headers do not clearly rule
// out, a throw must still be a well-formed mha::Error, and where the call succeeds its result must make
// sense.
#pragma once

#include <gtest/gtest.h>

#include <exception>
#include <functional>
#include <iostream>
#include <ostream>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "support/message_matches.hpp"
#include "support/test_util.hpp"

namespace mha_test {

struct BadCase {
  const char* name;
  std::function<void()> call;
  const char* names_arg;  // ECMAScript regex the message must match (the argument's name)
};

inline void PrintTo(const BadCase& c, std::ostream* os) { *os << c.name; }

inline std::string bad_case_name(const ::testing::TestParamInfo<BadCase>& info) { return info.param.name; }

static_assert(std::is_base_of_v<std::invalid_argument, mha::Error>);

// The check of every table case: c.call() throws mha::Error, whose message matches c.names_arg.
inline void expect_error_naming_the_argument(const BadCase& c) {
  bool threw = false;
  try {
    c.call();
  } catch (const std::invalid_argument& e) {
    threw = true;
    EXPECT_NE(dynamic_cast<const mha::Error*>(&e), nullptr)
        << "a std::invalid_argument that is not mha::Error: " << e.what();
    EXPECT_TRUE(message_matches(e.what(), c.names_arg))
        << "message does not name the argument (/" << c.names_arg << "/): " << e.what();
  } catch (const std::exception& e) {
    threw = true;
    ADD_FAILURE() << "threw a std::exception that is not mha::Error: " << e.what();
  } catch (...) {
    threw = true;
    ADD_FAILURE() << "threw something that is not a std::exception";
  }
  EXPECT_TRUE(threw) << "no exception";
}

// For inputs the headers do not clearly rule in or out: if the call throws, it must be an mha::Error
// naming the argument; if it succeeds, the result is checked where the header implies one. Either way
// the behaviour is printed for the report.
inline void expect_error_if_thrown(const std::function<void()>& call, const char* names_arg, const char* what) {
  try {
    call();
    std::cout << "[ note ] " << what << ": accepted\n";
  } catch (const std::invalid_argument& e) {
    std::cout << "[ note ] " << what << ": rejected: " << e.what() << "\n";
    EXPECT_NE(dynamic_cast<const mha::Error*>(&e), nullptr) << e.what();
    EXPECT_TRUE(message_matches(e.what(), names_arg)) << e.what();
  }
}

}  // namespace mha_test
