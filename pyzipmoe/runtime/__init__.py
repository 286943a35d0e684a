"""Running zipmoe models: ``Llama``, the llama.cpp programs, memory readings and budgets, the one runtime
configuration, and the controller that re-plans the expert cache while a model runs."""
