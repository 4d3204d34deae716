// The `mha` command: multi-head attention (Vaswani et al. 2017, section 3.2) from the shell.
//
// Exit status: 0 success; 1 an error while running (printed as "mha: error: <message>"), including
// a demo whose heads fail their check; 2 a command-line misuse (CLI11's message).
#include <cstdio>
#include <exception>
#include <string>

#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include "demo.hpp"
#include "demo_heads.hpp"
#include "mha/error.hpp"

namespace {

constexpr int kExitError = 1;
constexpr int kExitUsage = 2;

void add_demo_command(CLI::App& app, mha_cli::DemoOptions& options) {
  CLI::App* demo = app.add_subcommand(
      "demo", "Hand-built heads that attend by four rules (previous, next, same symbol, first): scores, check, maps");
  demo->add_option("--out", options.out_dir, "Directory for the attention-map images and index.html")
      ->capture_default_str();
  demo->add_option("--threads", options.threads, "Threads for the library's kernels (0: its default)")
      ->check(CLI::Range(0, 1024))
      ->capture_default_str();
  demo->add_option("--text", options.text, "The token sequence, one token per character")
      ->check(CLI::Validator([](std::string& text) { return mha_cli::demo::check_text(text); }, ""))
      ->capture_default_str();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"mha: multi-head attention (\"Attention Is All You Need\", section 3.2)", "mha"};
  app.set_version_flag("--version", std::string("mha ") + MHA_VERSION);
  app.require_subcommand(1);
  mha_cli::DemoOptions demo_options;
  add_demo_command(app, demo_options);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // app.exit prints --help / --version (status 0) or the misuse (CLI11's own codes, 100+): we use 2.
    return app.exit(e) == 0 ? 0 : kExitUsage;
  }

  try {
    if (app.got_subcommand("demo")) return mha_cli::run_demo(demo_options);
  } catch (const mha::Error& e) {
    fmt::print(stderr, "mha: error: {}\n", e.what());
    return kExitError;
  } catch (const std::exception& e) {  // files that cannot be written, unexpected results
    fmt::print(stderr, "mha: error: {}\n", e.what());
    return kExitError;
  }
  return 0;
}
