"""The search (`fatune search`) and what it measures with.

shape (a workload: sizes, mask variant, inputs), timing (training steps and kernels, timed on the GPU),
target (where a search runs, its checker), space (the configs a search may try), study (one kernel's Optuna
study), trials (a shape's trials in flight), search (shapes pipelined, winners measured and stored),
storage / workers / precompile (many processes and hosts on one search), refresh (re-timing stale entries),
competitors (torch SDPA per backend and FlexAttention), compile_log (compiler output kept off the terminal),
first_use (tuning a key on its first call: fatune.autotune).
It imports the library below it (runtime, db, call, kernel; the search module fatune.api too); fatune.bench and
fatune.cli import it, and fatune.api imports first_use alone (which takes fatune.attention as an argument).
"""
