"""Layer 1: how per-client work is executed: the client map (`parallel`), its autotuner,
multi-device placement (`distributed`) and memory sizing (`memory`). Knows nothing of
algorithms or data."""
