"""A fuzzer of tandem's edges: structure-aware mutations of small GGUF files, hostile chat templates and flags, each
case run through the CLI in a forked child under a memory cap and a timeout (docs/ROBUSTNESS.md).

A case passes when the CLI exits 0, or 2 with one `error:` line (argparse's usage error included); a traceback, any
other exit code, a signal, a hang past the timeout or a MemoryError is a finding. `python -m tandem.fuzz --help`.
"""
