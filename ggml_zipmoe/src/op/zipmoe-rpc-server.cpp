// zipmoe-rpc-server.cpp - ggml-rpc-server's zipmoe flags (zipmoe-rpc.h, patches/0009): --zipmoe-model and the
// expert cache's flags, which set the same ZIPMOE_* variables as in every llama.cpp program (zipmoe-args.cpp).
// Compiled into ggml-rpc-server.
#include "zipmoe-args.h"
#include "zipmoe-rpc.h"

#include <cstdio>
#include <string>

static std::string g_model; // --zipmoe-model

bool zipmoe_rpc_server_flag(const std::string & flag) {
    return flag == "--zipmoe-model" || common_zipmoe_is_flag(flag);
}

bool zipmoe_rpc_server_set(const std::string & flag, const char * value) {
    if (!*value) {
        std::fprintf(stderr, "zipmoe: error: %s needs a value\n", flag.c_str());
        return false;
    }
    if (flag == "--zipmoe-model") {
        g_model = value;
    } else {
        common_zipmoe_flag(flag, value);
    }
    return true;
}

std::string zipmoe_rpc_server_usage() {
    char line[400];
    std::snprintf(line, sizeof line, "  %-44s%s\n", "--zipmoe-model <PATH>",
                  "zipmoe: compute the experts of the layers a client places here from this copy of its zipmoe GGUF "
                  "(the same file: checked by its integrity record when the client loads), in this machine's "
                  "expert cache under --memory-budget (default: clients compute their experts themselves)");
    return line + common_zipmoe_usage();
}

bool zipmoe_rpc_server_start() {
    return g_model.empty() || zipmoe_rpc_serve(g_model.c_str());
}
