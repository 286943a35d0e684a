// zipmoe-control.h - the control channel between a llama.cpp program and the pyzipmoe process that supervises it
// (zipmoe run, zipmoe serve): a new budget split in, the runtime's resident bytes out (zipmoe-control.cpp).
#pragma once

#include <string>

// Applies a budget split the supervisor published since the last call, if any, and publishes the runtime's
// resident bytes; cheap when nothing changed (one load of a shared word). Called where a graph begins, before
// zipmoe_cache_begin_graph; the first call starts a thread that does the same between graphs.
void zipmoe_control_poll();

// What the load message adds about adapting: whether a supervisor (ZIPMOE_CONTROL) follows the memory available,
// or the budget is fixed for the run.
std::string zipmoe_control_load_note();
