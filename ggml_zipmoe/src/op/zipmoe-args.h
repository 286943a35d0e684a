// zipmoe-args.h - zipmoe's flags in llama.cpp's programs (patches/0005): the expert cache's settings
// (--memory-budget, --cache-policy, --hot-share, --sm-share, --cache-plan) for every program that parses common's
// arguments, and for llama-bench's own parser. A flag sets the ZIPMOE_* variable that the runtime reads when a model
// loads (ggml_zipmoe/src/common/config.c), so flags, their LLAMA_ARG_* twins and ZIPMOE_* variables have one way
// in. Compiled into llama-common.
#pragma once

#include "arg.h"

#include <string>
#include <utility>
#include <vector>

// The flags, as common_arg options for common_params_parser_init.
std::vector<common_arg> common_zipmoe_args();

// llama-bench's hand-made parser: whether arg is one of the flags; set it (value must not be empty); the flags'
// lines for its --help.
bool        common_zipmoe_is_flag(const std::string & flag);
void        common_zipmoe_flag(const std::string & flag, const std::string & value);
std::string common_zipmoe_usage();

// Once the arguments are parsed, before anything loads: a thread count above GGML_MAX_N_THREADS, or a memory budget,
// policy or plan that zipmoe's parsers do not read (named as given: the flag, its twin or the ZIPMOE_* variable) is
// refused with one line; then, under a memory budget, the program starts again with a short OpenMP spin unless the
// user said how OpenMP threads wait (libgomp reads that when it loads, before main).
// common's parser (the threads of -t, -tb, -td, -tbd): throws std::invalid_argument with the line.
void common_zipmoe_parsed(char ** argv, const common_params & params);
// llama-bench's (-t): "" or the line.
std::string common_zipmoe_parsed_bench(char ** argv, const std::vector<int> & n_threads);
