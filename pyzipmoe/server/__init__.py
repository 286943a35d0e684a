"""`zipmoe serve` without a MODEL: every model of the store behind one HTTP server, with Ollama's REST API
(/api/*) and OpenAI's (/v1/*), and one memory budget shared by the models it has loaded.

    client ──HTTP──► front (this package, aiohttp, one process)
                       ollama.py           Ollama's requests and answers <-> llama-server's, pure functions
                       app.py              the app: its route table, errors, CORS
                       store_routes.py     /api/tags, show, ps, copy, delete, create
                       generate_routes.py  /api/generate, chat, embed: translated to llama-server's and back
                       openai_routes.py    /v1/*: passed through
                       request.py          what every route reads of a request
                       stream.py           llama-server's errors and server-sent events in, Ollama's NDJSON out
                       children.py         one llama-server per loaded model: load on first use, keep_alive, LRU
                       budget.py           the server's budget divided between the loaded models (control files)
                     ──HTTP──► llama-server -m <blob>   (one per loaded model, on a loopback port)

Why a Python front and a process per model of its own rather than llama-server's router mode (docs/serving.md):
the router starts every child with the router's own environment (server-models.cpp: child_env = base_env) and
a preset can only add command-line options, so it cannot give each child its own control file (ZIPMOE_CONTROL),
through which the budget is divided; and Ollama's endpoints, keep_alive per request and budget-driven unloading
need a layer in front anyway, which, talking to the children directly, saves the router's second proxy hop.
"""

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8080  # where `zipmoe serve` listens, and `zipmoe ps`/`stop` call
DEFAULT_PARALLEL = 4  # requests a model answers at once (llama-server's own default); more wait for a slot
