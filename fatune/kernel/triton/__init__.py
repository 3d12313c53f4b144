"""The Triton kernel family: templates/triton/ rendered (codegen), its parameter lists (signature), which
structures run for a spec (structure), a config as a launch runs it and its hashes (resolve), the launch plan
(launch), built-in configs (heuristics), shared-memory estimates (resources), offline sm_90 compiles (offline),
the dropout keep-mask (dropout), and the family's entry in the registry (family).
It imports from fatune.kernel's shared modules, fatune.settings, fatune.hardware and fatune.logs.
"""
