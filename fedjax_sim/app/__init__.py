"""Layer 5: the application: the command line (`cli`, `sweep_cli`), run configs and their
assembly (`config`), up-front validation (`validate`) and the benchmark harness (`bench`).
Defers JAX-backed imports so that a bad flag is refused before JAX starts."""
