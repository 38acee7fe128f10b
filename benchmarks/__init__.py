"""The benchmark tools users run against the peers (llama.cpp, Hugging Face, a server), as a
package: `python -m benchmarks.NAME --help` from the repository root. Their current results are in
docs/results.md; the one-off probes and the history of results live in lab/."""
