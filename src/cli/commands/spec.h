// `talon generate` and `talon eval`: options and the commands' console output.
#pragma once
#include <CLI/CLI.hpp>

#include "spec/eval.h"
#include "spec/generate.h"

namespace talon {

CLI::App* add_generate_subcommand(CLI::App& app, spec::GenerateOptions& o);
// 0 done, 130/143 stopped by a signal (the caller prints the resume hint).
int run_generate_command(const spec::GenerateOptions& o);

struct EvalCli {
  spec::EvalOptions opt;
  std::string chain = "3,5,7", tree = "6,8,32", temperatures = "0";
  bool no_tree = false, no_chain = false;
  CLI::Option* tree_opt = nullptr;  // to tell a --tree given from the default
};
CLI::App* add_eval_subcommand(CLI::App& app, EvalCli& o);
int run_eval_command(EvalCli& o);

}  // namespace talon
