"""Ollama-style model packages: names, manifests and blobs in a local models directory, created from a Modelfile,
exported and imported as archives."""
