"""Layer 4: running an algorithm: the one run loop (`loop`) and the drivers that feed it chunks
(`simulate`, `streaming`, `sweep`), history, checkpoints and evaluation (`dro`,
`convergence`)."""
