"""What runs a call: its plan, prepared once per call signature (plans), with the config the dispatcher chose
through its layers (dispatch: the config argument, the user's tuned DB, the shipped DBs, the heuristic), or the
torch SDPA backend a tuned entry measured faster (routes).
It imports fatune.call, fatune.db and fatune.kernel; fatune.api and fatune.ops import it.
"""
