"""The drafter served: stage `export` (the engines' formats), `speculate` (offline acceptance), `serve_bench`
(bench.py: the engine with and without the drafter) and `engine_check` (can the engine serve or extract)."""
